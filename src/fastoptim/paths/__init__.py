"""The paths: each way a bucket can run (loop, foreach, compiled, torch's fused kernel, the CPU kernel, Triton,
Triton on stored formats, staged, per-tensor stages). Which path runs which params is the dispatcher's choice
(``fastoptim.engine.dispatch``)."""
