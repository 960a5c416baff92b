"""The step loop: LLMEngine, its scheduler and request state, the runner that runs a step
on the device (persistent batch, sampler, CUDA graphs), and the start-up and warm-up that
bring them up."""
