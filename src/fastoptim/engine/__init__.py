"""The step engine: the step plan (buckets, step counts, staleness), flat buffers, the state mapping, GradScaler's
handshake, and the dispatcher that hands each bucket to the paths."""
