"""The engine behind a server: AsyncEngine (the asyncio facade), its loop on a thread or in
a child process (EngineProcess), and one RequestStream per request."""
