"""Host side: the single-controller loop that queues, batches, allocates, and finishes requests."""

from scheduler.request import FinishReason, Req, ReqOutput
from scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["FinishReason", "Req", "ReqOutput", "Scheduler", "SchedulerConfig"]
