"""Structured output: the constraints a request may put on its output, and the token masks
llguidance makes of them."""
