-- The queue model's shared helpers (after the KEY, FIELD and constant tables rendered from
-- backends/contract/keys.py). Every queue script starts with these, so a rule about where a job
-- waits, which tenant it is, or what its tenant holds is written here once.

-- the queue name in a queue key ('rq:queue:<name>')
local function queue_name_of(key) return string.sub(key, KEY.QUEUE_PREFIX_LEN + 1) end

-- A queue name's pool queue ('<pool>:<priority>') and tenant: '<pool>:<priority>:<tenant>' is a
-- named tenant's queue (keys.tenant_queue_name); any other name is a default-tenant queue.
local function split_queue(name)
  local base, tenant = string.match(name or '', '^(.*:[^:]+):([^:]+)$')
  if base and tenant ~= DEFAULT_TENANT and #tenant <= 64 and string.match(tenant, TENANT_PATTERN)
      and PRIORITIES[string.match(base, ':([^:]+)$')] then
    return base, tenant
  end
  return name, DEFAULT_TENANT
end

-- whether `name` is a pool's queue ('<pool>:<priority>') or a tenant's queue of one
local function is_fleet_queue(name)
  local base = split_queue(name)
  return type(base) == 'string' and PRIORITIES[string.match(base, ':([^:]+)$')] == true
end

-- the queue a tenant's jobs of pool queue `base` wait in
local function tenant_queue(base, tenant)
  if tenant == DEFAULT_TENANT then return base end
  return base .. ':' .. tenant
end

-- A named tenant with work is listed in its pool queue's fair share (claim.lua visits only the
-- tenants listed there); a newcomer enters at FAIR_NEWCOMER, which the claim lifts
-- (backends/contract/queue/fair.py).
local function join_fair(base, tenant)
  if tenant == DEFAULT_TENANT then return end  -- the claim lists the pool queue's own jobs itself
  local fair = KEY.fair(base)
  if redis.call('TYPE', fair).ok ~= 'zset' and redis.call('EXISTS', fair) == 1 then return end
  redis.call('ZADD', fair, 'NX', FAIR_NEWCOMER, tenant)
  redis.call('EXPIRE', fair, FAIR_TTL)
end

-- Put a job id back at the FRONT of the queue it came from (`queue`: a pool or tenant queue
-- name), its tenant listed in the fair share. A queue key that is not a list (a producer wrote
-- it) sends the job to its pool queue: nothing after a job left its in-flight list may fail.
local function push_front(queue, id)
  local base, tenant = split_queue(queue)
  local key = KEY.queue(tenant_queue(base, tenant))
  local kind = redis.call('TYPE', key).ok
  if kind ~= 'list' and kind ~= 'none' then
    key, tenant = KEY.queue(base), DEFAULT_TENANT
  end
  redis.call('LPUSH', key, id)
  join_fair(base, tenant)
  return key
end

-- A job lets go of its tenant's admission places (admit.lua): its queued place as it starts, both
-- as it ends or leaves the queue for good.
local function release_places(tenant, id, ended)
  redis.call('ZREM', KEY.tenant_queued(tenant), id)
  if ended then redis.call('ZREM', KEY.tenant_open(tenant), id) end
end

-- The job hash's RQ origin (the queue it was enqueued on), nil when the key is not a hash.
local function origin_of(job_key)
  if redis.call('TYPE', job_key).ok ~= 'hash' then return nil end
  local origin = redis.call('HGET', job_key, 'origin')
  if type(origin) ~= 'string' then return nil end
  return origin
end
