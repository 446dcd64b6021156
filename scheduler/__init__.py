"""Pure-Python policy for carpool: sampling parameters, sequences, KV block
management, the step scheduler, lanes, the job schema and the Redis key schema.
Imports no torch."""

from scheduler.block_manager import BlockManager, CachedPrefix
from scheduler.params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from scheduler.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "BlockManager",
    "CachedPrefix",
    "FinishReason",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
