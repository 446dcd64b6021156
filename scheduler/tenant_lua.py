"""Every Redis script about tenants, each one atomic: routing into tenant streams, retiring an empty tenant,
reserving against a tenant's rate limits, and settling a finished job's tokens.

Field and key names are those of ``scheduler.keys`` and ``scheduler.job_record``.
"""

from __future__ import annotations

from scheduler.job_record import F_RESERVATION, F_USAGE_COUNTED
from scheduler.tenants import DEFAULT_TENANT, MAX_TENANT_LEN

# Stream ids compare as (ms, seq) pairs; both parts fit a Lua number exactly.
_ID_LUA = """
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

# Who: any worker, before reading a lane. Moves the lane stream's not-yet-delivered entries whose job names a
# tenant into that tenant's stream (same fields, plus `routed_from` = the original id, whose time is the
# job's enqueue time), and marks the tenant active. Entries for the default tenant, and entries that cannot
# be read, stay where they are, untouched and undelivered: nothing is taken out of the group's hands.
# KEYS: lane stream, route cursor, the lane's active-tenant set, wake stream.
# ARGV: group, scan count, tenant stream prefix, wake maxlen. -> entries moved.
ROUTE = _ID_LUA + """
local last = nil
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return 0 end
for _, g in ipairs(groups) do
  for j = 1, #g, 2 do
    if g[j] == 'name' and g[j + 1] == ARGV[1] then
      for k = 1, #g, 2 do if g[k] == 'last-delivered-id' then last = g[k + 1] end end
    end
  end
end
if not last then return 0 end
local start = redis.call('GET', KEYS[2]) or '0-0'
if id_after(last, start) then start = last end
local entries = redis.call('XRANGE', KEYS[1], '(' .. start, '+', 'COUNT', tonumber(ARGV[2]))
local moved = 0
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  local raw = nil
  for j = 1, #fields, 2 do if fields[j] == 'job' then raw = fields[j + 1] end end
  local tenant = nil
  if raw then
    local okd, job
    if string.sub(raw, 1, 1) == '{' then okd, job = pcall(cjson.decode, raw) else okd, job = pcall(cmsgpack.unpack, raw) end
    if okd and type(job) == 'table' and type(job['tenant']) == 'string' then tenant = job['tenant'] end
  end
  if tenant and tenant ~= '@default@' and #tenant <= @maxlen@ and string.match(tenant, '^[%w][%w%._%-]*$') then
    local stream = ARGV[3] .. tenant
    if redis.call('EXISTS', stream) == 0 then
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
return moved
""".replace("@default@", DEFAULT_TENANT).replace("@maxlen@", str(MAX_TENANT_LEN))

# Who: any worker, after a tenant's stream came up short. A tenant leaves its lane's active set only when its
# stream holds nothing at all (workers delete the entries they acknowledge, so a pending entry keeps it in,
# for reclaiming). The gateway's enqueue adds the entry and the tenant in one script, so none is stranded.
# KEYS: the lane's active-tenant set, then one stream per tenant. ARGV: the tenants. -> tenants retired.
DEACTIVATE = """
local n = 0
for i = 1, #ARGV do
  if redis.call('XLEN', KEYS[i + 1]) == 0 then n = n + redis.call('SREM', KEYS[1], ARGV[i]) end
end
return n
"""

# Who: the gateway, before admitting a request of a rate-limited tenant. The window starts with the tenant's
# first request and lasts ARGV[2] ms; a refused request counts nothing.
# KEYS: the tenant's window hash. ARGV: now ms, window ms, requests/min limit|'', tokens/min limit|'', tokens.
# -> {verdict ('ok' | 'requests' | 'tokens'), requests, tokens, window ms left, window id}; the counts are
#    after the request when it was admitted, before it otherwise.
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

# Who: the worker that decided a job (any outcome), or the gateway for a reservation no job took. Once per job:
# adds its tokens to the tenant's usage and, while the window it reserved in is still open, replaces the
# reservation by the tokens really used (prompt + completion).
# KEYS: job record, tenant window hash, tenant usage hash.
# ARGV: status, prompt tokens, completion tokens. -> 1 when this call settled the job, 0 when it was already.
SETTLE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HSETNX', KEYS[1], '@counted@', '1') == 0 then return 0 end
local prompt, completion = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('HINCRBY', KEYS[3], 'jobs', 1)
redis.call('HINCRBY', KEYS[3], 'jobs_' .. ARGV[1], 1)
redis.call('HINCRBY', KEYS[3], 'prompt_tokens', prompt)
redis.call('HINCRBY', KEYS[3], 'completion_tokens', completion)
local reservation = redis.call('HGET', KEYS[1], '@reservation@')
if reservation then
  local window, reserved = string.match(reservation, '^(%S+) (%d+)$')
  if window and redis.call('HGET', KEYS[2], 'id') == window then
    redis.call('HINCRBY', KEYS[2], 'tokens', prompt + completion - tonumber(reserved))
  end
end
return 1
""".replace("@counted@", F_USAGE_COUNTED).replace("@reservation@", F_RESERVATION)

# Who: the gateway, for a reservation whose request enqueued no job (refused after reserving). Gives the
# tokens back while the window is still the one they were reserved in.
# KEYS: the tenant's window hash. ARGV: window id, tokens.
RELEASE = """
if redis.call('HGET', KEYS[1], 'id') == ARGV[1] then
  return redis.call('HINCRBY', KEYS[1], 'tokens', -tonumber(ARGV[2]))
end
return 0
"""
