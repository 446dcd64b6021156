"""What every carpool process shares, with the scheduling policy at its root.

The modules of this package itself are the scheduling policy, and import only
the standard library (an import-linter contract in pyproject.toml checks it),
so the batching policy is testable on a laptop without torch: sampling
parameters (``params``), sequences (``sequence``), KV blocks and the prefix
cache (``block_manager``), the step scheduler (``scheduler``), its settings,
batching modes and policies (``scheduler_config``) and its output
(``scheduler_output``).

Its subpackages hold what the gateway, the workers and the webhook dispatchers
share but is not policy; they may import the policy, never the other way round:

- ``scheduler.protocol``: the job protocol: the job message, the job record, the
  Redis keys, lanes, webhook deliveries, reply decoding, and every Lua script,
  as one documented state machine (``state_machine``);
- ``scheduler.telemetry``: OpenTelemetry set-up, the metric schema, JSON logs,
  process gauges and the lane-depth poller;
- ``scheduler.runtime``: what every process does at its edge: flags from config
  dataclasses, the ``--model`` check, terminal text, owned-task helpers.

They live here rather than in a package of their own because the top level is
fixed (gateway, worker, scheduler, kernels, bench) and both the gateway and the
worker import them: under either one, the other would import across.
"""

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
