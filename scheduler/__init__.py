"""Pure-Python policy for carpool: sampling parameters, sequences, KV block
management, the step scheduler, lanes, the job schema and the Redis key schema.
Imports no torch."""

from scheduler.params import SamplingParams

__all__ = ["SamplingParams"]
