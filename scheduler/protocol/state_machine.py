"""Every Lua script carpool runs on Redis: the moves of a job record, a webhook delivery and a batch.

Each script is one atomic step, so a process that dies or loses its connection
mid-way leaves all of a move or none of it. This module holds their source;
the code that calls a script (``register_script`` on its client) sits with the
process that owns the move.

Job record (``keys.job(id)``, fields ``job_record.F_*``)::

    (none) ──ENQUEUE──▶ queued ──START──▶ running ──COMMIT──▶ succeeded | failed | cancelled | expired
       │                  │                │  ▲
       └──START (a job    ├──CANCEL───────▶│  └─START (an entry reclaimed after its worker's lease lapsed)
          XADDed directly)│  cancelled     ├─STEP (checkpoint), HAND_BACK (handbacks + 1)
                          └──COMMIT (cancel flag, passed deadline, invalid job): terminal
                                           └─CANCEL raises the cancel flag; the worker COMMITs ``cancelled``

=============  ========================  ====================================================================
move           who                       what
=============  ========================  ====================================================================
ENQUEUE        gateway (admission)       create the record ``queued`` and XADD its lane entry, claiming the
                                         ``Idempotency-Key`` in the same step
RELEASE_KEY    gateway (admission)       forget an idempotency key that names a job whose record is gone
START          worker (intake)           take a lane entry's job to ``running`` (creating the record of a
                                         directly XADDed job), or say why not: terminal, another entry's,
                                         cancel flagged, past its deadline
STEP           worker (job loop)         one engine step's token events, ``output`` webhooks and
                                         checkpoints; each only while its job is ``running`` here
RENEW_LEASE    worker (consumer)         keep this worker's lane entries pending and fresh
HAND_BACK      worker (shutdown)         make this worker's entries look idle so another worker takes them
COMMIT         worker (commit)           the job's terminal status, unless it has one already
CANCEL         gateway (``DELETE``)      ``queued`` → ``cancelled``, its lane entry deleted and its tenant's
                                         usage settled; a ``running`` job gets its cancel flag
=============  ========================  ====================================================================

A terminal status never changes: the first terminal write wins, and a loser
publishes, replies and calls back nothing. Every terminal write goes through
one Lua function, ``commit_terminal``: the record, then its ``final`` event,
the reply entry and the ``completed`` webhook delivery (``COMMIT`` and
``CANCEL`` both include it). Scripts name record fields and statuses as
``@status@``, ``@queued@``…; ``_job_script`` fills them in from
``job_record`` and ``JobStatus``, so a script cannot drift from the names the
rest of the code reads.

Webhook delivery (``keys.webhook_delivery(id)``): ``pending ──CLAIM──▶ sending
──SETTLE──▶ delivered | retrying | dead | gone`` (``RELEASE``: back to
``pending``), moved only by the dispatchers; ``INGEST`` turns the webhook
stream's entries into deliveries on their job's chain.

Batch (``keys.batch(id)``): ``BATCH_MOVE`` is a compare-and-set of its status
by the gateway's batch driver and routes; ``BATCH_SETTLE`` counts each line's
outcome once.

Tenants: workers move a lane's entries into their tenant's stream
(``ROUTE_TO_TENANTS``) and retire tenants whose streams are empty
(``RETIRE_TENANTS``); the gateway reserves against a tenant's rate limits
(``RESERVE``, ``RELEASE_RESERVATION``), and whoever decides a job settles its
tokens into the tenant's usage once (``SETTLE_USAGE``).
"""

from __future__ import annotations

import re
from enum import StrEnum

from scheduler.protocol import job_record
from scheduler.protocol.job import TERMINAL_STATUSES, JobStatus
from scheduler.protocol.tenants import DEFAULT_TENANT, MAX_TENANT_LEN

_FIELDS = {
    name[2:].lower(): value for name, value in vars(job_record).items() if name.startswith("F_") and isinstance(value, str)
} | {"webhook_attempt_prefix": job_record.WEBHOOK_ATTEMPT_PREFIX}
_STATUSES = {status.value: status.value for status in JobStatus}
_PLACEHOLDER = re.compile(r"@(\w+)@")

_TERMINAL = (
    "local function terminal(s) return "
    + " or ".join(f"s == '{s.value}'" for s in sorted(TERMINAL_STATUSES, key=lambda s: list(JobStatus).index(s)))
    + " end\n"
)

# The one terminal write. The caller has already decided that it may write (the record is not terminal),
# and checked the reply key's type ('' for reply_result when there is no reply or the key is not a stream).
_COMMIT_TERMINAL = """
local function commit_terminal(job, status, record, ttl_s, channel, final, reply, reply_result, reply_maxlen,
                               webhooks, webhook)
  redis.call('HSET', job, '@status@', status, unpack(record))
  local batch_count = redis.call('HGET', job, '@batch_count@')
  if batch_count and redis.call('DECR', batch_count) < 0 then redis.call('SET', batch_count, 0) end
  if tonumber(ttl_s) > 0 then
    -- The result's time to live starts now; the idempotency key that names the job lives as long.
    redis.call('EXPIRE', job, ttl_s)
    local id = redis.call('HGET', job, '@id@')
    local idem = redis.call('HGET', job, '@idempotency_key@')
    if idem and redis.call('GET', idem) == id then redis.call('EXPIRE', idem, ttl_s) end
    for key in string.gmatch(redis.call('HGET', job, '@idempotency_keys@') or '', '[^\\n]+') do
      if redis.call('GET', key) == id then redis.call('EXPIRE', key, ttl_s) end
    end
  end
  redis.call('PUBLISH', channel, final)
  if reply_result ~= '' then redis.call('XADD', reply, 'MAXLEN', '~', reply_maxlen, '*', 'result', reply_result) end
  if #webhook > 0 then redis.call('XADD', webhooks, '*', unpack(webhook)) end
end
"""


def _job_script(source: str) -> str:
    """``source`` with ``@field@`` and ``@status@`` names filled in; an unknown name is a bug here."""

    def name(match: re.Match[str]) -> str:
        key = match.group(1)
        if key in _FIELDS:
            return _FIELDS[key]
        if key in _STATUSES:
            return _STATUSES[key]
        raise KeyError(f"unknown job record name @{key}@ in a script")

    return _PLACEHOLDER.sub(name, source)


# Whether a name is a tenant with streams of its own (``tenants.is_tenant_name``, but not the default tenant).
_IS_NAMED = """
local function is_named(tenant)
  return tenant and tenant ~= '@default@' and #tenant <= @maxlen@ and string.match(tenant, '^[%w][%w%._%-]*$') ~= nil
end
""".replace("@default@", DEFAULT_TENANT).replace("@maxlen@", str(MAX_TENANT_LEN))

# The tenant a packed job message (msgpack, or JSON from a direct producer) names: '' for the default tenant,
# as ``tenants.tenant_of`` reads it.
_NAMED_TENANT = _IS_NAMED + """
local function named_tenant(raw)
  local tenant = nil
  if raw then
    local ok, job
    -- JSON as the worker takes it (scheduler.protocol.job.looks_like_json): after a UTF-8 byte order mark and
    -- JSON's whitespace, if any; anything else is msgpack.
    local text = raw
    if string.sub(text, 1, 3) == '\\239\\187\\191' then text = string.sub(text, 4) end
    if string.match(text, '^[ \\t\\r\\n]*{') then ok, job = pcall(cjson.decode, text)
    else ok, job = pcall(cmsgpack.unpack, raw) end
    if ok and type(job) == 'table' and type(job['tenant']) == 'string' then tenant = job['tenant'] end
  end
  if is_named(tenant) then return tenant end
  return ''
end
"""

# A lane's jobs waiting or running: its tenants' streams (workers delete the entries they acknowledge, so a
# stream's length is its depth) and the lane stream, whose consumer group on Redis 7+ tells the entries not
# yet delivered (``lag``, unknown after some deletions) and delivered but unacknowledged (``pending``); where
# it cannot, the stream's length. Tenant streams are named here from the lane's active set, as workers read it.
_LANE_DEPTH = """
local function lane_depth(lane, tenants, tenant_prefix, group)
  local depth = 0
  for _, name in ipairs(redis.call('SMEMBERS', tenants)) do
    if is_named(name) then depth = depth + redis.call('XLEN', tenant_prefix .. name) end
  end
  if redis.call('TYPE', lane)['ok'] ~= 'stream' then return depth end
  for _, reply in ipairs(redis.call('XINFO', 'GROUPS', lane)) do
    local info = {}
    for i = 1, #reply, 2 do info[reply[i]] = reply[i + 1] end
    if info['name'] == group and info['lag'] then return depth + info['lag'] + info['pending'] end
  end
  return depth + redis.call('XLEN', lane)
end
"""

# ---- job record: gateway ---------------------------------------------------------------------------

ENQUEUE = _job_script(_TERMINAL + _NAMED_TENANT + _LANE_DEPTH + """
local has_key = ARGV[3] == '1'
if has_key then
  local owner = redis.call('GET', KEYS[3])
  if owner then return {'claimed', owner} end
end
local tenant = ARGV[6]
local status = redis.call('HGET', KEYS[1], '@status@')
if status then
  if named_tenant(redis.call('HGET', KEYS[1], '@spec@')) ~= tenant then return {'taken'} end
  if has_key then
    -- The key lives as long as the record: an ended job's for the rest of its result's time to live; a waiting
    -- or running one's until it ends, when the commit gives it the result's (the record lists it for that).
    local ttl = redis.call('TTL', KEYS[1])
    redis.call('SET', KEYS[3], ARGV[4], 'EX', ttl > 0 and ttl or ARGV[1])
    local keys = redis.call('HGET', KEYS[1], '@idempotency_keys@') or ''
    if not terminal(status) and redis.call('HGET', KEYS[1], '@idempotency_key@') ~= KEYS[3]
        and not string.find('\\n' .. keys .. '\\n', '\\n' .. KEYS[3] .. '\\n', 1, true) then
      redis.call('HSET', KEYS[1], '@idempotency_keys@', keys == '' and KEYS[3] or (keys .. '\\n' .. KEYS[3]))
    end
  end
  return {'exists', status}
end
-- Counted here, not before the script: requests admitted at once must each see the others' jobs.
local depth = lane_depth(KEYS[7], KEYS[4], ARGV[12], ARGV[8])
if depth + tonumber(ARGV[10]) > tonumber(ARGV[2]) then return {'full', tostring(depth)} end
local is_batch_line = ARGV[11] == '1'
if tenant ~= '' and ARGV[7] ~= '' and not is_batch_line then
  -- The tenant's jobs waiting or running, but for its Batch API lines: they are paced by the lane, and count
  -- apart (KEYS[6]); never more of them than the streams hold (a count left high by a line whose record
  -- vanished is brought back down here).
  local queued = 0
  for i = 8, #KEYS do queued = queued + redis.call('XLEN', KEYS[i]) end
  local lines = tonumber(redis.call('GET', KEYS[6]) or '0')
  if lines > queued then
    redis.call('SET', KEYS[6], queued)
    lines = queued
  end
  queued = queued - lines
  if queued + tonumber(ARGV[10]) > tonumber(ARGV[7]) then return {'quota', tostring(queued)} end
end
if tenant ~= '' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[2], ARGV[8], '0', 'MKSTREAM')
end
-- Never trimmed: an accepted job stays until a worker acknowledges and deletes it (the depth check bounds the lane).
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[5])
if tenant ~= '' and redis.call('SADD', KEYS[4], tenant) == 1 then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', 'tenant', tenant)
end
local fields = {}
for i = 13, #ARGV do fields[#fields + 1] = ARGV[i] end
fields[#fields + 1] = '@stream_entry@'
fields[#fields + 1] = KEYS[2] .. ' ' .. entry
if is_batch_line and tenant ~= '' then
  redis.call('INCR', KEYS[6])
  fields[#fields + 1] = '@batch_count@'  -- commit_terminal counts the line out when the job ends
  fields[#fields + 1] = KEYS[6]
end
if has_key then
  fields[#fields + 1] = '@idempotency_key@'
  fields[#fields + 1] = KEYS[3]
end
-- ARGV[1], the queued time to live, is long (a backstop for a job that never ends): when the job ends, its
-- record and the key it names get the result's time to live (commit_terminal).
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if has_key then redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[1]) end
return {'enqueued', entry}
""")
"""Gateway: a new job enters its lane ``queued``, with its idempotency key, or is refused.

No failure (a killed gateway, a lost connection) can leave an idempotency key naming a job that was never
enqueued: the key is claimed together with the record and lane entry. A named tenant's job goes to the
tenant's stream of the lane, created with the consumer group if new, and the tenant joins the lane's active
set in the same step (a newly active tenant rings the wake stream), so no worker can retire the tenant
between the two. The lane's depth is counted here, in the same step as the entry is added, so requests
admitted at once never take the lane past its maximum; so is the tenant's queued-jobs quota, over its streams
in every lane (workers delete what they acknowledge, so a stream's length is waiting + running); both with
room for the jobs of the same request still to come. A job id is one tenant's: a record of another tenant's
under this id is neither returned nor named by the key, and its status is not told.

KEYS: job record, lane stream (the tenant's), idempotency key (the tenant's; the job record again when the
request has none), the lane's active-tenant set, wake stream, the tenant's count of Batch API lines waiting or
running, the lane stream (the default tenant's), then the tenant's stream in every lane.
ARGV: queued ttl_s (the record's and the key's until the job ends), the lane's maximum depth, '1' when KEYS[3]
is an idempotency key, job id, packed spec, tenant ('' for the default tenant, whose stream is the lane
stream), max queued jobs|'', group, wake maxlen, jobs the lane and the quota must have room for (this one and
the request's next ones), '1' for a Batch API line (not held to the quota, counted in KEYS[6] until it ends),
the prefix of the lane's tenant streams (the tenant's name follows), then the record's field/value pairs.
Returns {'claimed', id} when the idempotency key already names a job, {'exists', status} when a record of
this tenant's exists for this id (the key, if any, then names it), {'taken'} when the record is another
tenant's, {'full', depth} when the lane, holding depth jobs, has no room for the request's, {'quota', n} when
the tenant already has n jobs waiting or running and no room for the request's, {'enqueued', entry id}."""

RELEASE_KEY = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
"""Delete a string key only while it still holds the given value. Gateway: forget an idempotency key only if it
still names the job whose record has gone; worker: give back its name's claim only if it still holds its token.
KEYS: the key. ARGV: the value (job id, claim token)."""

RENEW_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
"""Worker: renew the claim on its name while it is its own or has lapsed.
KEYS: the name's claim. ARGV: the worker's token, time to live in ms. Returns 0 where another worker holds it."""

# Count a decided job once in its tenant's usage, and settle its tokens/min reservation while the window it
# was reserved in is still open: the reservation is replaced by the tokens really used.
_SETTLE_USAGE = """
local function settle_usage(job, window, usage, status, prompt, completion)
  if redis.call('HSETNX', job, '@usage_counted@', '1') == 0 then return 0 end
  redis.call('HINCRBY', usage, 'jobs', 1)
  redis.call('HINCRBY', usage, 'jobs_' .. status, 1)
  redis.call('HINCRBY', usage, 'prompt_tokens', prompt)
  redis.call('HINCRBY', usage, 'completion_tokens', completion)
  local reservation = redis.call('HGET', job, '@reservation@')
  if reservation then
    local reserved_in, reserved = string.match(reservation, '^(%S+) (%d+)$')
    if reserved_in and redis.call('HGET', window, 'id') == reserved_in then
      redis.call('HINCRBY', window, 'tokens', prompt + completion - tonumber(reserved))
    end
  end
  return 1
end
"""

CANCEL = _job_script(_TERMINAL + _COMMIT_TERMINAL + _SETTLE_USAGE + """
local status = redis.call('HGET', KEYS[1], '@status@')
if not status then return 'missing' end
if status == '@queued@' then
  local reply_type = redis.call('TYPE', KEYS[3])['ok']
  local reply_result = ''
  if reply_type == 'none' or reply_type == 'stream' then reply_result = ARGV[8] end
  local entry = redis.call('HGET', KEYS[1], '@stream_entry@')
  commit_terminal(KEYS[1], '@cancelled@', {'@finished_at@', ARGV[1], '@error@', ARGV[2]}, ARGV[3], ARGV[6], ARGV[7],
                  KEYS[3], reply_result, ARGV[9], KEYS[4], {unpack(ARGV, 12)})
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  -- The job leaves its lane now: its entry stops counting in the lane's depth and the tenant's queued jobs, and
  -- no worker can meet it after the record has expired and take it for a new job. A worker that read it
  -- already finds the record cancelled when it comes to start it.
  if ARGV[10] ~= '' and entry == KEYS[5] .. ' ' .. ARGV[10] then
    redis.call('XACK', KEYS[5], ARGV[11], ARGV[10])
    redis.call('XDEL', KEYS[5], ARGV[10])
  end
  settle_usage(KEYS[1], KEYS[6], KEYS[7], '@cancelled@', 0, 0)
  return '+cancelled'
end
if status == '@running@' then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return '+cancelling'
end
return status
""")
"""Gateway: cancel a ``queued`` job on the spot (a terminal commit that also deletes its lane entry and settles
its tenant's usage), or flag a ``running`` one for its worker.

KEYS: job record, cancel flag, reply stream, webhook stream, the stream of the record's entry, the tenant's
window hash, the tenant's usage hash.
ARGV: now, packed error, ttl_s (the cancelled record's and the flag's), control channel, packed control message, events channel, packed
final event, packed reply result|'', reply maxlen, the record's entry id|'', group, then the webhook delivery's
field pairs.
Returns '+cancelled' or '+cancelling' when it acted, 'missing', or the status it found otherwise. A reply
key of another type than stream gets no reply; its type is checked before any write."""

# ---- job record: worker ----------------------------------------------------------------------------


class StartVerdict(StrEnum):
    """What ``START`` decided for a lane entry's job."""

    RUN = "run"
    """Now ``running`` here."""
    TERMINAL = "terminal"
    """Already decided: the entry is only acknowledged."""
    DUPLICATE = "duplicate"
    """Running from another entry of the same id: this one is only acknowledged."""
    CANCEL = "cancel"
    """Its cancel flag is up: it is committed ``cancelled`` without running."""
    EXPIRE = "expire"
    """Its deadline passed before it started: it is committed ``expired``."""


START = _job_script(_TERMINAL + """
local st = redis.call('HGET', KEYS[1], '@status@')
if terminal(st) then return {'terminal', st} end
if not st then
  redis.call('HSET', KEYS[1], '@id@', ARGV[8], '@status@', '@queued@', '@lane@', ARGV[4], '@priority@', ARGV[5],
             '@spec@', ARGV[3], '@created_at@', ARGV[6], '@stream_entry@', ARGV[7])
  -- A record of its own from here on, with the gateway's backstop for a job that never ends; the commit gives
  -- it the result's time to live.
  redis.call('EXPIRE', KEYS[1], ARGV[11])
  st = '@queued@'
elseif st == '@queued@' then
  -- A queued record is the job its entry carries (the gateway wrote both at once): another entry of the same id
  -- (a producer's XADD of an id the gateway had taken) is a second copy, while that entry is still there.
  local owner_entry = redis.call('HGET', KEYS[1], '@stream_entry@')
  if owner_entry and owner_entry ~= ARGV[7] then
    local stream, id = string.match(owner_entry, '^(.*) (%S+)$')
    if stream and #redis.call('XRANGE', stream, id, id) > 0 then return {'duplicate', st} end
  end
end
local function started(found, attempts)
  local record, flat = {}, redis.call('HGETALL', KEYS[1])
  for k = 1, #flat, 2 do
    if flat[k] ~= '@checkpoint@' then record[#record + 1] = flat[k]; record[#record + 1] = flat[k + 1] end
  end
  -- The job's first start ever is the one that counted its first attempt.
  return {'run', found, attempts == 1 and '1' or '0', tostring(attempts),
          redis.call('HGET', KEYS[1], '@checkpoint@') or '', record}
end
if st == '@running@' then
  local owner_entry = redis.call('HGET', KEYS[1], '@stream_entry@')
  if owner_entry and owner_entry ~= ARGV[7] then return {'duplicate', st} end
  if redis.call('HGET', KEYS[1], '@start_token@') == ARGV[10] then
    -- This very admission again, its first reply lost: that start stands, counted once.
    return started(redis.call('HGET', KEYS[1], '@start_found@'), tonumber(redis.call('HGET', KEYS[1], '@attempts@')))
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'cancel', st} end
if ARGV[9] ~= '' and st ~= '@running@' and tonumber(ARGV[2]) > tonumber(ARGV[9]) then return {'expire', st} end
redis.call('HSETNX', KEYS[1], '@started_at@', ARGV[2])
redis.call('HSET', KEYS[1], '@status@', '@running@', '@worker@', ARGV[1], '@stream_entry@', ARGV[7],
           '@start_token@', ARGV[10], '@start_found@', st)
return started(st, redis.call('HINCRBY', KEYS[1], '@attempts@', 1))
""")
"""Worker: take a lane entry's job to ``running`` (``running`` → ``running`` for a reclaimed entry).

KEYS: job record, cancel flag. ARGV: worker, now, packed spec, lane, priority, created_at, stream entry,
job id, deadline|'', start token (new for each admission of an entry), the time to live of a record made here
(a directly XADDed job's) until the job ends. Returns {verdict, status found, ...}:
'terminal' (decided already, by another entry's worker or by a cancel while it waited), 'duplicate' (running
from another entry, or queued with another entry still in its stream), 'cancel', 'expire', or 'run' with whether this is its
first start, its attempts, its checkpoint and the record (without the checkpoint). The same admission sent
again (its start token: the first reply was lost) gets the answer it got then: the job is not started twice."""

STEP = _job_script("""
local njobs, nevents, ndeliveries = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = {}
for j = 1, njobs do
  local found = redis.call('HMGET', KEYS[2 * j], '@status@', '@worker@')
  if not found[1] then
    state[j] = 3
  elseif found[1] ~= '@running@' or found[2] ~= ARGV[1] then
    state[j] = 0
  else
    state[j] = redis.call('EXISTS', KEYS[2 * j + 1]) == 1 and 2 or 1
  end
end
local i = 6
for _ = 1, nevents do
  local j = tonumber(ARGV[i])
  if state[j] == 1 or state[j] == 2 then
    redis.call('PUBLISH', ARGV[i + 1], ARGV[i + 3])
    redis.call('XADD', ARGV[i + 2], '*', 'e', ARGV[i + 3])
    redis.call('EXPIRE', ARGV[i + 2], ARGV[5])
  end
  i = i + 4
end
for _ = 1, ndeliveries do
  local j, nfields = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  if state[j] == 1 or state[j] == 2 then
    local entry = {}
    for k = 1, nfields * 2 do entry[k] = ARGV[i + k - 1] end
    redis.call('XADD', KEYS[1], '*', unpack(entry))
  end
  i = i + nfields * 2
end
local replies = {}
while i <= #ARGV do
  local j = tonumber(ARGV[i])
  if state[j] == 1 or state[j] == 2 then
    redis.call('HSET', KEYS[2 * j], '@checkpoint@', ARGV[i + 1])
    if ARGV[i + 2] ~= '' then redis.call('HSETNX', KEYS[2 * j], '@first_token_at@', ARGV[i + 2]) end
  end
  replies[#replies + 1] = state[j]
  i = i + 3
end
return replies
""")
"""Worker: everything one engine step writes, in order (a job's token events stay in order), for the jobs that
are still its own: a job whose record says it ended, or runs on another worker (this one lost its lease, paused
say), gets no more token events, ``output`` webhooks or checkpoints from here, so none lands after its end.

KEYS: webhook stream, then (job record, cancel flag) per job the step writes for.
ARGV: worker, n jobs, n events, n webhook deliveries, events log ttl_s, then (job, channel, events log, message) per
event, (job, n fields, field pairs...) per delivery, (job, checkpoint, first_token_at|'') per checkpoint, each
`job` the 1-based place of its pair in KEYS.
Returns per checkpoint: 1 stored, 0 not ours (not running, or running elsewhere), 2 cancel flagged (stored), 3 no
record (deleted, or lost by Redis)."""

RENEW_LEASE = """
local lost = {}
for i = 3, #ARGV do
  local info = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if info[1] and info[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""
"""Worker: reset the idle time of its own pending entries, so no other worker reclaims them.

One script, so no other worker's claim can fall between the ownership check and ours.
KEYS: lane stream. ARGV: group, consumer, entry ids. Returns the ids this consumer no longer owns."""

HAND_BACK = _job_script("""
local n = 0
for i = 5, #ARGV, 2 do
  local info = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if info[1] and info[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    if ARGV[4] == '1' then
      redis.call('HINCRBY', ARGV[i + 1], '@handbacks@', 1)
    end
    n = n + 1
  end
end
return n
""")
"""Worker (shutting down): each entry still its own is made to look long idle, and, when the worker stops
cleanly, its job counts one clean hand-back (a delivery that does not count against max_deliveries: the job
did nothing wrong). A worker stopping because its engine or a loop failed hands back uncounted: that delivery
counts, as a crash's would, so a job that brings down every worker it reaches ends within max_deliveries.
KEYS: lane stream. ARGV: group, consumer, idle ms, "1" for a clean hand-back (else ""), then (entry id, job
record key) pairs. Returns how many were handed back."""

COMMIT = _job_script(_TERMINAL + _COMMIT_TERMINAL + """
local won = 0
local reply_type = ''
if ARGV[6] ~= '' then
  local t = redis.call('TYPE', KEYS[3])['ok']
  if t ~= 'none' and t ~= 'stream' then reply_type = t end
end
local nwh, ndead = tonumber(ARGV[10]), tonumber(ARGV[11])
local i = 13
local wh, dead, rec = {}, {}, {}
for k = 1, nwh * 2 do wh[k] = ARGV[i]; i = i + 1 end
for k = 1, ndead * 2 do dead[k] = ARGV[i]; i = i + 1 end
while i <= #ARGV do rec[#rec + 1] = ARGV[i]; i = i + 1 end
local may_write
if ARGV[12] == '1' then may_write = redis.call('EXISTS', KEYS[1]) == 0
else may_write = not terminal(redis.call('HGET', KEYS[1], '@status@')) end
if may_write then
  local reply_result = ''
  if reply_type == '' then reply_result = ARGV[6] end
  commit_terminal(KEYS[1], ARGV[1], rec, ARGV[8], ARGV[4], ARGV[5], KEYS[3], reply_result, ARGV[7], KEYS[4], wh)
  won = 1
end
if ARGV[3] ~= '' then
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
  redis.call('XDEL', KEYS[2], ARGV[3])
end
if ndead > 0 then redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', unpack(dead)) end
return {won, reply_type}
""")
"""Worker: the one place a job's outcome is written. The record is persisted, then the final event, the
reply entry, the ``completed`` webhook delivery, XACK + XDEL of the lane entry and the dead-letter entry.

KEYS: job record, lane stream, reply stream, webhook stream, dead stream.
ARGV: status, group, entry id|'', events channel, packed final event, packed reply result|'', reply maxlen,
ttl_s, dead maxlen, n webhook fields, n dead fields, '1' to write only a record that does not exist yet|'',
then webhook pairs, dead pairs, record pairs. Returns {won, the reply key's type when it is not a stream
(no reply was added) | ''}. The type is checked before any write, so a reply key of another type cannot
fail the script half-way."""

# ---- webhook deliveries: dispatchers --------------------------------------------------------------

_IS_UTF8 = """
local function is_utf8(s)
  local i, n = 1, #s
  while i <= n do
    local c, len = string.byte(s, i), 0
    if c < 0x80 then len = 1
    elseif c >= 0xC2 and c <= 0xDF then len = 2
    elseif c >= 0xE0 and c <= 0xEF then len = 3
    elseif c >= 0xF0 and c <= 0xF4 then len = 4
    else return false end
    if i + len - 1 > n then return false end
    for j = i + 1, i + len - 1 do
      local b = string.byte(s, j)
      if b < 0x80 or b > 0xBF then return false end
    end
    local b2 = string.byte(s, i + 1)
    -- overlong three- and four-byte forms, UTF-16 surrogates, past U+10FFFF
    if (c == 0xE0 and b2 < 0xA0) or (c == 0xED and b2 > 0x9F) or (c == 0xF0 and b2 < 0x90)
        or (c == 0xF4 and b2 > 0x8F) then return false end
    i = i + len
  end
  return true
end
"""
"""Lua: whether a string is UTF-8 text as Python's strict decoder takes it."""

WEBHOOK_INGEST = _job_script(_IS_UTF8 + """
local entries = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if not entries then return 0 end
local n = 0
for _, entry in ipairs(entries[1][2]) do
  local eid, flat, f = entry[1], entry[2], {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  local missing = nil
  for _, name in ipairs({'id', 'job_id', 'event', 'url', 'payload'}) do
    if not f[name] or f[name] == '' then missing = name break end
  end
  local garbled = nil
  if not missing then
    for _, name in ipairs({'id', 'job_id', 'event', 'url', 'traceparent'}) do
      if f[name] and not is_utf8(f[name]) then garbled = name break end
    end
  end
  if missing then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], '*', 'entry', eid, 'at', ARGV[4],
      'reason', 'invalid webhook delivery entry: missing field ' .. missing)
  elseif garbled then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], '*', 'entry', eid, 'at', ARGV[4],
      'reason', 'invalid webhook delivery entry: field ' .. garbled .. ' is not UTF-8 text')
  else
    local dkey = ARGV[6] .. f['id']
    -- A delivery id seen before is the same delivery (a producer retrying its XADD).
    if redis.call('EXISTS', dkey) == 0 then
      redis.call('HSET', dkey, 'id', f['id'], 'job_id', f['job_id'], 'event', f['event'], 'url', f['url'],
        'payload', f['payload'], 'created_at', f['created_at'] or ARGV[4], 'attempts', 0, 'state', 'pending',
        'traceparent', f['traceparent'] or '')
      if redis.call('HEXISTS', ARGV[8] .. f['job_id'], '@webhook_gone@') == 1 then
        redis.call('HSET', dkey, 'state', 'gone')
        redis.call('EXPIRE', dkey, ARGV[5])
      else
        local chain = ARGV[7] .. f['job_id']
        local len = redis.call('RPUSH', chain, f['id'])
        redis.call('EXPIRE', chain, ARGV[5])
        if len == 1 then redis.call('ZADD', KEYS[2], ARGV[4], f['id']) end
      end
      n = n + 1
    end
  end
  redis.call('XACK', KEYS[1], ARGV[1], eid)
  redis.call('XDEL', KEYS[1], eid)
end
return n
""")
"""Dispatcher: move new webhook stream entries into delivery hashes (``pending``) on their job's chain;
only a chain's head is scheduled, so a receiver sees ``started``, then the ``output``s, then ``completed``.
An entry missing a field, or whose id, job id, event, URL or trace context is not UTF-8 text, goes to the
dead stream with the reason instead.
KEYS: webhook stream, retry zset, webhook dead stream. ARGV: group, consumer, count, now, ttl_s, delivery
key prefix, chain key prefix, job key prefix, dead maxlen. Returns how many were new."""

WEBHOOK_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
local out = {}
for _, id in ipairs(ids) do
  local dkey = ARGV[4] .. id
  if redis.call('EXISTS', dkey) == 0 then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    redis.call('HSET', dkey, 'claim', ARGV[5], 'state', 'sending')
    local attempt = redis.call('HINCRBY', dkey, 'attempts', 1)
    local d = redis.call('HMGET', dkey, 'job_id', 'event', 'url', 'payload', 'traceparent')
    table.insert(out, {id, attempt, d[1], d[2], d[3], d[4], d[5] or ''})
  end
end
return out
"""
"""Dispatcher: ``pending`` → ``sending`` for the due heads; their due time moves forward by a lease instead
of leaving the retry zset, so a dispatcher that dies mid-attempt leaves the delivery to be retried.
KEYS: retry zset. ARGV: now, lease until, limit, delivery key prefix, claim token."""

WEBHOOK_SETTLE = _job_script("""
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[2] then return 0 end
local outcome = ARGV[3]
redis.call('HDEL', KEYS[1], 'claim')
redis.call('HSET', KEYS[1], 'state', outcome, 'last_at', ARGV[6])
local has_job = redis.call('EXISTS', KEYS[3]) == 1
if has_job then
  local n = redis.call('HINCRBY', KEYS[3], '@webhook_count@', 1)
  redis.call('HSET', KEYS[3], '@webhook_attempt_prefix@' .. n, ARGV[5])
end
if outcome == 'retrying' then
  redis.call('HSET', KEYS[1], 'next_at', ARGV[4])
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 1
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'next_at')
redis.call('EXPIRE', KEYS[1], ARGV[7])
if outcome == 'dead' then
  local d = redis.call('HMGET', KEYS[1], 'job_id', 'event', 'url', 'attempts', 'payload')
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[8], '*', 'id', ARGV[1], 'job_id', d[1], 'event', d[2],
    'url', d[3], 'attempts', d[4], 'reason', ARGV[9], 'at', ARGV[6], 'payload', d[5])
end
local gone = outcome == 'gone'
if gone and has_job then redis.call('HSET', KEYS[3], '@webhook_gone@', ARGV[1]) end
redis.call('LREM', KEYS[4], 1, ARGV[1])
while true do
  local nxt = redis.call('LINDEX', KEYS[4], 0)
  if not nxt then break end
  if not gone then
    redis.call('ZADD', KEYS[2], ARGV[6], nxt)
    break
  end
  redis.call('LPOP', KEYS[4])
  redis.call('HSET', ARGV[10] .. nxt, 'state', 'gone')
  redis.call('EXPIRE', ARGV[10] .. nxt, ARGV[7])
end
return 1
""")
"""Dispatcher holding the claim: ``sending`` → ``delivered`` | ``retrying`` | ``dead`` | ``gone``, the attempt
recorded on the job record, the chain's next delivery scheduled (or, after a 410, all of them gone).
KEYS: delivery, retry zset, job record, chain, webhook dead stream. ARGV: id, claim token, outcome, next_at,
packed attempt record, now, ttl_s, dead maxlen, reason, delivery key prefix. Returns 0 when the claim lapsed."""

WEBHOOK_RELEASE = """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'claim')
redis.call('HSET', KEYS[1], 'state', 'pending')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
"""Dispatcher holding the claim, shutting down: ``sending`` → ``pending``, due again at once.
KEYS: delivery, retry zset. ARGV: id, claim token, now. Returns 0 when the claim lapsed."""

WEBHOOK_REPLAY = """
local entry = redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1])[1]
if not entry then return 0 end
local flat, f = entry[2], {}
for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
if not f['id'] or not f['payload'] then return 0 end
local dkey = ARGV[3] .. f['id']
local state = redis.call('HGET', dkey, 'state')
if state and state ~= 'dead' then return 0 end
redis.call('DEL', dkey)
redis.call('XADD', KEYS[1], '*', 'id', f['id'], 'job_id', f['job_id'], 'event', f['event'], 'url', f['url'],
  'payload', f['payload'], 'created_at', ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[1])
return 1
"""
"""Operator: a dead-lettered delivery (the dead stream's entry ARGV[1]) back on the webhook stream under its own
id, so the receiver sees the same ``webhook-id``; its dead delivery hash is dropped first (ingest keeps an id it
has seen), and the dead entry goes. An entry that is no delivery (a malformed stream entry's record) or whose
delivery lives again is left alone.
KEYS: webhook stream, webhook dead stream. ARGV: dead entry id, now, delivery key prefix. Returns 1 when moved."""

# ---- batches: the gateway's batch routes and driver -----------------------------------------------

FILE_DELETE = """
local existed = redis.call('DEL', KEYS[1])
if redis.call('SCARD', KEYS[3]) == 0 then redis.call('DEL', KEYS[2]) end
return existed
"""
"""Delete a file: its listing at once, its lines unless a batch still reads them. KEYS: file hash, lines,
readers. Returns 1 when the file existed."""

FILE_RELEASE = """
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('SCARD', KEYS[3]) == 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
end
return 0
"""
"""A batch done reading a file: the file's lines go when it was the last reader of a file deleted or expired
meanwhile. KEYS: file hash, lines, readers. ARGV: batch id."""

BATCH_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if allowed == status then
    local n = tonumber(ARGV[3])
    redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 4, 3 + n))
    if #ARGV > 3 + n then redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4 + n)) end
    return status
  end
end
return status
"""
"""Compare-and-set of a batch's status. KEYS: batch hash, webhook stream. ARGV: allowed current statuses
(comma-separated), new status, number of field/value arguments n, n arguments to set with the status, then
the fields of a webhook delivery to XADD in the same step (none: no callback). Returns the status found (nil
when there is no batch)."""

BATCH_SETTLE = """
local n = 0
for i = 1, #ARGV, 5 do
  if redis.call('SETBIT', KEYS[2], ARGV[i], 1) == 0 then
    n = n + 1
    redis.call('HINCRBY', KEYS[1], 'settled', 1)
    local o = ARGV[i + 1]
    if o == 'completed' or o == 'failed' then redis.call('HINCRBY', KEYS[1], o, 1) end
    if o == 'expired' then
      redis.call('HINCRBY', KEYS[1], 'failed', 1)
      redis.call('HINCRBY', KEYS[1], 'expired', 1)
    end
    if o == 'completed' then
      redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[i + 2])
      redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[i + 3])
      redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[i + 4])
    end
  end
end
return n
"""
"""Count each line of a batch once. KEYS: batch hash, settled bitmap. ARGV: (line, outcome, input tokens,
cached input tokens, output tokens) per line; outcomes: completed, failed, expired, dropped. Returns how many
were new."""


# ---- tenants: routing into tenant streams, rate limits, usage ---------------------------------------

# Stream ids compare as (ms, seq) pairs; both parts fit a Lua number exactly.
_STREAM_IDS = """
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms or 0), tonumber(seq or 0)
end
local function id_after(a, b)
  local am, as = id_parts(a)
  local bm, bs = id_parts(b)
  return am > bm or (am == bm and as > bs)
end
"""

ROUTE_TO_TENANTS = _STREAM_IDS + _NAMED_TENANT + """
local last = nil
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return {0} end
for _, g in ipairs(groups) do
  for j = 1, #g, 2 do
    if g[j] == 'name' and g[j + 1] == ARGV[1] then
      for k = 1, #g, 2 do if g[k] == 'last-delivered-id' then last = g[k + 1] end end
    end
  end
end
if not last then return {0} end
local start = redis.call('GET', KEYS[2]) or '0-0'
if id_after(last, start) then start = last end
local entries = redis.call('XRANGE', KEYS[1], '(' .. start, '+', 'COUNT', tonumber(ARGV[2]))
local moved = 0
local blocked = {}
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  local raw = nil
  for j = 1, #fields, 2 do if fields[j] == 'job' then raw = fields[j + 1] end end
  local tenant = named_tenant(raw)
  local stream = ARGV[3] .. tenant
  local kind = tenant ~= '' and redis.call('TYPE', stream)['ok'] or 'none'
  if kind ~= 'none' and kind ~= 'stream' then
    blocked[stream] = true
  elseif tenant ~= '' then
    if kind == 'none' then
      redis.call('XGROUP', 'CREATE', stream, ARGV[1], '0', 'MKSTREAM')
    end
    local copy = {}
    for j = 1, #fields do copy[j] = fields[j] end
    copy[#copy + 1] = 'routed_from'
    copy[#copy + 1] = id
    redis.call('XADD', stream, '*', unpack(copy))
    redis.call('XDEL', KEYS[1], id)
    if redis.call('SADD', KEYS[3], tenant) == 1 then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'tenant', tenant)
    end
    moved = moved + 1
  end
  start = id
end
redis.call('SET', KEYS[2], start)
local out = {moved}
for stream in pairs(blocked) do out[#out + 1] = stream end
return out
"""
"""Any worker, before reading a lane: move the lane stream's not-yet-delivered entries whose job names a
tenant into that tenant's stream (same fields, plus ``routed_from`` = the original id, whose time is the
job's enqueue time), and mark the tenant active. Entries for the default tenant, entries that cannot be
read, and entries whose tenant's stream holds another Redis type stay where they are, untouched and
undelivered: nothing is taken out of the group's hands, and the lane's readers serve them.
KEYS: lane stream, route cursor, the lane's active-tenant set, wake stream. ARGV: group, scan count, tenant
stream prefix, wake maxlen. Returns {entries moved, then each tenant stream of another type that kept its
entries in the lane}."""

STRAY_SCAN_TURN = """
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('GET', KEYS[1]) or '0'
end
return false
"""
"""Any worker, each sweep: take the fleet's turn to walk the next slice of the key space for stray tenant streams,
unless another worker took it less than a sweep interval ago. KEYS: the shared cursor, the turn. ARGV: worker,
interval ms. Returns the cursor to go on from (``0``: from the start), or nil when it is not this worker's turn."""

RETIRE_TENANTS = """
local n = 0
for i = 1, #ARGV do
  if redis.call('XLEN', KEYS[i + 1]) == 0 then n = n + redis.call('SREM', KEYS[1], ARGV[i]) end
end
return n
"""
"""Any worker, after a tenant's stream came up short: a tenant leaves its lane's active set only when its
stream holds nothing at all (workers delete the entries they acknowledge, so a pending entry keeps it in, for
reclaiming). ``ENQUEUE`` adds the entry and the tenant in one step, so none is stranded.
KEYS: the lane's active-tenant set, then one stream per tenant. ARGV: the tenants. Returns tenants retired."""

RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'requests', 0, 'tokens', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
local left = redis.call('PTTL', KEYS[1])
local id = redis.call('HGET', KEYS[1], 'id')
local want = tonumber(ARGV[5])
if ARGV[3] ~= '' and requests + 1 > tonumber(ARGV[3]) then return {'requests', requests, tokens, left, id} end
if ARGV[4] ~= '' and tokens + want > tonumber(ARGV[4]) then return {'tokens', requests, tokens, left, id} end
requests = redis.call('HINCRBY', KEYS[1], 'requests', 1)
tokens = redis.call('HINCRBY', KEYS[1], 'tokens', want)
return {'ok', requests, tokens, left, id}
"""
"""Gateway, before admitting a request of a rate-limited tenant. The window starts with the tenant's first
request and lasts ARGV[2] ms; a refused request counts nothing.
KEYS: the tenant's window hash. ARGV: now ms, window ms, requests/min limit|'', tokens/min limit|'', tokens.
Returns {verdict ('ok' | 'requests' | 'tokens'), requests, tokens, window ms left, window id}; the counts are
after the request when it was admitted, before it otherwise."""

SETTLE_USAGE = _job_script(_SETTLE_USAGE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return settle_usage(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
""")
"""The worker that decided a job (any outcome), or the gateway for a reservation no job took; once per job:
add its tokens to the tenant's usage and, while the window it reserved in is still open, replace the
reservation by the tokens really used (prompt + completion).
KEYS: job record, tenant window hash, tenant usage hash. ARGV: status, prompt tokens, completion tokens.
Returns 1 when this call settled the job, 0 when it was already."""

RELEASE_RESERVATION = """
if redis.call('HGET', KEYS[1], 'id') == ARGV[1] then
  -- 0 - n, not -n: Lua writes -0 as "-0", which HINCRBY refuses.
  redis.call('HINCRBY', KEYS[1], 'requests', 0 - tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[1], 'tokens', 0 - tonumber(ARGV[3]))
end
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
return {requests, tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0), redis.call('PTTL', KEYS[1])}
"""
"""Gateway, for a request refused after reserving, or answered with a job that already existed: give back its
request and the tokens of the jobs it did not enqueue, while the window is still the one they were reserved
in. KEYS: the tenant's window hash. ARGV: window id, requests, tokens. Returns {requests, tokens, window ms
left} as they stand after (a window that has ended counts nothing)."""
