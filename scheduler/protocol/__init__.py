"""The job protocol: what crosses Redis between producers, the gateway, workers and webhook dispatchers.

The job message and its validation (``job``), the job record's fields and view (``job_record``), every
Redis key and its lifetime (``keys``), the lanes (``lanes``), webhook deliveries (``webhooks``), values
a message may carry (``wire_values``), reading Redis replies (``redis_replies``), and every Lua script
that moves a record from one state to the next (``state_machine``).
"""
