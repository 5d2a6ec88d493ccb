"""The scheduler (continuous batching, chunked prefill, preemption, priority) and what it
hands to the model runner (SchedulerOutput) and back to the front end (EngineCoreOutput)."""
