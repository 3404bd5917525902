-- acquire.lua: one atomic "acquire" for one hash slot: check n rate limits and consume from
-- them, then, if they admitted the request, acquire its idempotency record, then its lease.
--
-- PEEK: a local set before this file (src/redis/scripts/mod.rs assembles the script with a
-- first line `local PEEK = false` for `acquire`, `local PEEK = true` for `peek`). With PEEK the
-- script only reads: the fast path is skipped, phase 1 makes no repair, phase 2 does not run,
-- and the idempotency and lease sections must be off (a script error otherwise). Its reply is
-- acquire's for the same arguments as of phase 1: whether a request of that cost would be
-- admitted now, and each limit's state before that request (remaining before consumption;
-- reset_ms and retry_after_ms as now). Overrides are read under PEEK as without it, so a peek
-- shows each limit as the caller's own quota counts it. The operator's tool (cg-admin limits)
-- calls it with a cost of 1; the filter never does.
--
-- KEYS[1..n]   rate-limit counters, KEYS[i] for limit i (n = ARGV[1]; may be 0); a
--              concurrency limit's key is a sorted set of the requests holding a slot
-- KEYS[n+1]    idempotency record, present iff the idempotency section is on
-- then, iff the lease section is on, two more keys after the record (if any):
--   lease key   the lease, a string holding the owner token
--   fence key   the fencing counter, a string holding the last fencing token issued
-- then, iff ARGV[O] (below) is given, the override keys of the limits it lists, in its order:
--   for each, the principal's override (when it has two keys), then the tenant's: a string
--   `<limit>/<window_ms>[/<burst>]` (cg-admin override writes it), usually absent
-- KEYS[last]   cancellation marker of the owner token, optional: present iff #KEYS is one
--              more than the keys above (the filter always passes it when the idempotency or
--              the lease section is on). The filter writes it (release.lua,
--              lease_release.lua) when it gave up on this very call (timeout, client gone):
--              a call that finds it writes no record, takes no lease (codes 6 / 3 below)
--              and takes no concurrency slot, so a late acquire cannot leave anything
--              behind. Passed too when a concurrency limit is among the limits.
--              All keys share one hash tag and the script touches no other key, so it is
--              Redis Cluster safe.
-- ARGV[1]      n: number of rate limits (integer >= 0)
-- ARGV[2]      nonce: string unique per request (makes sliding_log members unique; the member
--              of a concurrency slot)
-- ARGV[3 .. 2+6n]  six values per limit i, starting at ARGV[3 + (i-1)*6]:
--   algo       "fw" fixed_window | "sw" sliding_window | "sl" sliding_log | "tb" token_bucket
--              | "lq" leased quota: a fixed window that hands out slices (see below)
--              | "cc" concurrency: at most `limit` slots held at once (see below)
--   limit      integer > 0
--   window_ms  integer > 0 (cc: the lifetime of a slot unless extended); for fw and lq also
--              a calendar spec, '<period>@<zone>' (piece_calendar.lua): the window is then
--              the calendar day, week or month that holds Redis TIME, in that zone
--   burst      integer > 0, token bucket capacity (ignored by the others)
--   shadow     "1": reported but never rejects | "0"
--   cost       integer >= 0, units this request consumes from this limit (cc: must be 1)
-- ARGV[3+6n]   "1": idempotency section on | "0": off (then ARGV[4+6n..6+6n] may be omitted)
-- ARGV[4+6n]   fingerprint ("sha256:<64 hex>")
-- ARGV[5+6n]   owner token (32 hex)
-- ARGV[6+6n]   processing_ttl_ms: integer > 0, lease of the PROCESSING record
-- ARGV[L]      "1": lease section on | "0" or absent: off (then nothing follows);
--              L = 4+6n when the idempotency section is off, 7+6n when it is on
-- ARGV[L+1]    lease owner token (32 hex; must not be empty)
-- ARGV[L+2]    lease_ttl_ms: integer > 0
-- ARGV[L+3]    fence_ttl_ms: integer > 0, TTL of the fence key, set again at every ACQUIRED
-- ARGV[O]      overrides, optional (absent: none; the call is then what it was before overrides
--              existed): O = L + 1 when the lease section is off, L + 4 when it is on (the lease
--              flag is then given). m >= 1, the number of limits with override keys (limits
--              with `overrides: true`), then two values for each, in increasing position: its
--              position among the limits (1..n) and its number of override keys (1: the
--              tenant's; 2: the principal's, then the tenant's)
--
-- Reply: flat array
--   [1]  admitted: 1 if every non-shadow limit allows the request, else 0 (1 when n = 0)
--   then 4 integers per limit i, at 2 + (i-1)*4:
--     allowed         1/0, this limit's own verdict
--     remaining       units left, after consumption if admitted, else as of now; >= 0
--                     ("lq" when admitted: the size of the slice granted, >= cost;
--                     "cc": free slots)
--     reset_ms        ms until this limit has more room than `remaining` says, if nothing
--                     else arrives (the `t` of the RateLimit header): fw until the window
--                     ends (window_ms if no window is open; a calendar fw: until the calendar
--                     period ends, open or not); sw until the estimate has dropped by one
--                     whole unit; sl until the oldest entry in the window leaves it; tb until
--                     the next token; cc until the last slot held expires unless extended (an
--                     upper bound). 0 when nothing is used (remaining is the whole quota; fw:
--                     window_ms); >= 0
--     retry_after_ms  if allowed == 0: ms until a request of this cost would be allowed, >= 1;
--                     else 0
--   then, iff the idempotency section is on, 3 more values at 2 + 4n:
--     code     integer: 0 SKIPPED (rate limits did not admit; nothing written)
--                       1 ACQUIRED (PROCESSING record created, owned by ARGV[5+6n])
--                       2 IN_PROGRESS (same fingerprint, state PROCESSING)
--                       3 COMPLETED (same fingerprint; a value that starts as complete.lua
--                         writes a COMPLETED record of this fingerprint is one, unread past
--                         that head: the filter parses the record)
--                       4 CONFLICT (different fingerprint, any state)
--                       5 UNREADABLE (the value is not a record we can read: not JSON, not an
--                         object, no string fingerprint, state neither PROCESSING nor
--                         COMPLETED, or not a string key at all)
--                       6 CANCELLED (the cancellation marker exists: nothing written)
--     pttl_ms  integer: the record's PTTL after the call (-2 if absent, -1 if it has no TTL)
--     record   bulk string: the stored record JSON for code 3, else "" (never for CONFLICT)
--   then, iff the lease section is on, 2 more values (after the idempotency values, if any):
--     code     0 SKIPPED (rate limits did not admit, or the idempotency section is on and its
--                code is not 1 ACQUIRED; nothing written for the lease)
--              1 ACQUIRED (SET lease <owner> NX PX lease_ttl_ms succeeded)
--              2 BUSY (the lease exists, held by another owner or by this one: no re-entrancy)
--              3 CANCELLED (the cancellation marker exists: nothing written, no token)
--     value    ACQUIRED: the fencing token, as a decimal STRING; BUSY: the lease's PTTL in
--              ms, >= 1 (1 if it has no TTL, which is left as it is); SKIPPED: 0
--   then, iff ARGV[O] is given, 4 integers per limit it lists, in its order: the limit's
--     position, the limit and window_ms it was counted with (its override's, else its own
--     ARGV's), and how many of its override values were unreadable and ignored (0 to 2)
--   The reply never holds a nil (webdis would drop it), and no integer of more than 10
--   digits: webdis 0.1.9 crashes on one inside an array (and truncates a top-level one), so
--   the ~16-digit fencing token travels as a string.
--
-- Order: rate limits first, then idempotency. Phase 1 checks every limit without writing;
-- only if admitted, phase 2 consumes each limit's `cost` from every limit whose own verdict
-- is allow (a concurrency limit: takes a slot), and then the idempotency record is acquired.
-- A limit admits while its count plus the cost fits; a cost of 0 (the real amount is charged
-- after the response, charge.lua) admits while the count is below the limit. So a rejected request consumes nothing anywhere
-- and writes no record, and a duplicate (codes 2-5) has still consumed its rate limits.
-- The one write outside that rule: a fw counter found without a TTL gets one, because it
-- would otherwise reject forever. An existing record is never written. The lease is taken
-- last, only by a request that was admitted and (with idempotency on) acquired its record, so
-- a replay, a duplicate in progress or a conflict never holds it.
--
-- Calendar windows: a fw or lq limit whose window is a calendar spec counts in the same one
-- counter, which lives until the calendar period that holds Redis TIME ends (PEXPIRE of the
-- whole ms left, rounded down, at least 1, so a counter never outlives its period), and
-- answers that period's end as reset_ms whether a counter exists or not. So "10000 a month"
-- starts again at the first midnight of each month in the limit's zone, on every sidecar at
-- once. A calendar limit cannot be listed with overrides (a script error): an override holds
-- a window in ms.
--
-- Fencing token: token = max(stored + 1, now_us), stored = the fence key's value (0 if
-- absent, or not a non-negative integer below 2^53), now_us = Redis TIME in µs; then
-- SET fence token PX fence_ttl_ms. Tokens of one fence key strictly increase, also after the
-- key expired or was evicted, as long as Redis TIME does not go backwards (e.g. a failover
-- to a replica whose clock is behind). The resource the lease protects must check them.
--
-- The PROCESSING record, compact JSON, TTL processing_ttl_ms:
--   {"schema_version":1,"state":"PROCESSING","fingerprint":"sha256:..","owner":"..",
--    "created_ms":<Redis TIME, ms>,"updated_ms":<same>}
--
-- Overrides: a limit with override keys is counted with the first readable value among them
-- (a principal's beats its tenant's): its limit, window and burst replace the limit's ARGV
-- before anything is counted, so every algorithm below counts with them, and a leased
-- quota's slices are cut from them. A value is readable when it is `<limit>/<window_ms>`, or
-- for a token bucket also `<limit>/<window_ms>/<burst>` (burst defaults to the limit), with
-- limit and burst in 1..10^9, window_ms in 1..8640000000 (100 days: webdis cannot carry a
-- longer integer in a reply) and, for a token bucket, window_ms >= limit. Anything else (a
-- key that is not a string too) is ignored and counted in the reply, never an error: the
-- request is counted with the next value, or its own ARGV. The counter keeps its key (the
-- configuration's limit and window are part of it): a fixed window's new limit applies at
-- once and its new window from the next window; a sliding window whose window changes
-- starts its two windows again.
--
-- Arguments are validated before anything is read or written (but the override keys, read
-- first once their own arguments are checked); a bad one is a script error.
--
-- Time comes from redis.call('TIME') so every proxy agrees; it is read once, and only when a
-- sw, sl or tb limit, a calendar window or the lease section is on (fw and lq use Redis
-- TTLs), or when the idempotency section creates a record (a replay reads no clock). It is
-- kept in microseconds (about 1.7e15, exact in a double) and every reply value is converted
-- to whole ms.
--
-- Cost: every rate-limited request runs this script, so a call pays only for what it uses.
-- No closures or tables per algorithm, limit or section: each algorithm is inline code in
-- an if-chain (but sw's roll-over: window_roll, and a calendar window's period:
-- calendar_zone and calendar_period, each shared with charge.lua, are piece_window_roll.lua
-- and piece_calendar.lua, put before this file; a calendar window's zone is one table, made
-- only for a call that has one; and sw's wait, sw_wait, one function made with the clock's
-- helpers, used for its retry_after and reset_ms in both phases), phase 1 writes each verdict
-- straight into
-- the reply and keeps what phase 2 needs in one flat table, and the idempotency and lease
-- code runs only when that section is on (and the overrides' code, with its one table, only
-- when the call lists overrides: first, so that a call with override keys takes the fast path
-- as one without does). fw skips PTTL for a counter that GET found absent
-- (PTTL would say -2). The usual call of the exact path, one fixed-window limit and nothing
-- else, takes the fast path first.

-- Overrides, for every call that lists them (ARGV[O] and the override keys; see the header):
-- once their own arguments are checked, each listed limit's keys are read (one GET each:
-- absent reads as false, another type as an error table; a principal's readable value spares
-- reading the tenant's), the first readable value replaces the limit's limit, window and
-- burst in ARGV, and the section is taken off ARGV and KEYS. The code below then sees the
-- call it would see without overrides, the fast path too, and only the reply grows: by
-- o1..o4 on the fast path (its one limit), by ovr_reply on the general code's.
local o1, o2, o3, o4, ovr_reply
if #KEYS > 1 or ARGV[11] ~= nil then -- the usual call has one key and ten arguments
  local n = tonumber(ARGV[1]) or 0
  local idem_on = ARGV[3 + 6 * n] == '1'
  local L = (idem_on and 7 or 4) + 6 * n
  local lease_on = ARGV[L] == '1'
  local O = L + (lease_on and 4 or 1)
  local m = ARGV[O] and tonumber(ARGV[O])
  if ARGV[O] ~= nil then
    local function wrong(what) error('acquire.lua: overrides: ' .. what, 0) end
    if not (m and m >= 1 and m % 1 == 0 and ARGV[O + 2 * m + 1] == nil) then
      wrong('ARGV[' .. O .. '] must be the number of limits listed after it')
    end
    local base = n + (idem_on and 1 or 0) + (lease_on and 2 or 0)
    local k, last, values = base, 0, {}
    for j = 1, m do
      local i, c = tonumber(ARGV[O + 2 * j - 1]), tonumber(ARGV[O + 2 * j])
      if not (i and i % 1 == 0 and i > last and i <= n) then
        wrong('ARGV[' .. (O + 2 * j - 1) .. '] must be a limit position after the last')
      end
      if c ~= 1 and c ~= 2 then wrong('ARGV[' .. (O + 2 * j) .. '] must be 1 or 2') end
      if #KEYS < k + c then wrong('fewer keys than listed') end
      local a = 3 + (i - 1) * 6
      if not tonumber(ARGV[a + 2]) then
        wrong('limit ' .. i .. ' has a calendar window: an override holds a window in ms')
      end
      local tb, found, ignored = ARGV[a] == 'tb', false, 0
      for key = k + 1, k + c do
        local raw = not found and redis.pcall('GET', KEYS[key])
        if raw then
          local ls, ws, bs
          if type(raw) == 'string' then
            ls, ws, bs = string.match(raw, '^(%d+)/(%d+)/(%d+)$')
            if not ls then ls, ws = string.match(raw, '^(%d+)/(%d+)$') end
          end
          local l, w = tonumber(ls), tonumber(ws)
          local b = tonumber(bs) or l
          if l and w and b and l >= 1 and l <= 1000000000 and w >= 1 and w <= 8640000000
              and b >= 1 and b <= 1000000000 and (tb and w >= l or (not tb and bs == nil)) then
            ARGV[a + 1], ARGV[a + 2], ARGV[a + 3] = l, w, b
            found = true
          else
            ignored = ignored + 1
          end
        end
      end
      k, last = k + c, i
      local v = #values
      values[v + 1], values[v + 2] = i, tonumber(ARGV[a + 1])
      values[v + 3], values[v + 4] = tonumber(ARGV[a + 2]), ignored
    end
    for x = O + 2 * m, O, -1 do ARGV[x] = nil end
    for _ = base + 1, k do table.remove(KEYS, base + 1) end
    ovr_reply = values
    if m == 1 then o1, o2, o3, o4 = values[1], values[2], values[3], values[4] end
  end
end

-- Fast path: the exact path's usual call, one fixed-window limit at a cost of at least 1, not
-- a shadow, with nothing else (no idempotency, no lease, no cancellation marker). Its reply
-- and writes are those of the general code below, in two calls instead of four (three when
-- it rejects): INCRBY first, taken back when the cost does not fit (INCRBY -cost, or DEL when
-- the counter held nothing before it: a counter at 0 is as good as none, the next request
-- opens a new window on either). Any other call, or an argument the checks below do not
-- accept, goes to the general code, which validates everything.
if not PEEK and #KEYS == 1 and ARGV[1] == '1' and ARGV[3] == 'fw' and ARGV[7] == '0'
    and ARGV[9] == '0' and (ARGV[10] == nil or (ARGV[10] == '0' and ARGV[11] == nil)) then
  local limit, window_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
  local burst, cost = tonumber(ARGV[6]), tonumber(ARGV[8])
  -- x % 1 == 0 is false for a fraction, inf and NaN
  if limit and window_ms and burst and cost and limit >= 1 and window_ms >= 1 and burst >= 1
      and cost >= 1 and limit % 1 == 0 and window_ms % 1 == 0 and burst % 1 == 0
      and cost % 1 == 0 then
    local key = KEYS[1]
    local c = redis.call('INCRBY', key, ARGV[8] == '1' and '1' or cost) -- '1' as it came
    if c == cost then
      if c <= limit then
        redis.call('PEXPIRE', key, window_ms) -- a new window
        return { 1, 1, limit - c, window_ms, 0, o1, o2, o3, o4 }
      end
      redis.call('DEL', key) -- nothing was there: nothing is left
      return { 0, 0, limit, window_ms, window_ms, o1, o2, o3, o4 }
    end
    local ttl = redis.call('PTTL', key)
    if ttl < 0 then
      redis.call('PEXPIRE', key, window_ms) -- without a TTL it would reject forever
      ttl = window_ms
    end
    if c <= limit then return { 1, 1, limit - c, ttl, 0, o1, o2, o3, o4 } end
    redis.call('INCRBY', key, -cost) -- taken back (INCRBY: the gateway's ACL has no DECRBY)
    return { 0, 0, math.max(0, limit - c + cost), ttl, math.max(1, ttl), o1, o2, o3, o4 }
  end
end

local function bad(what) error('acquire.lua: ' .. what, 0) end

local function count_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v % 1 ~= 0 or v < min then -- v % 1 is NaN for inf and NaN
    bad('ARGV[' .. i .. '] must be an integer >= ' .. min .. ', got ' .. tostring(ARGV[i]))
  end
  return v
end

local n = count_arg(1, 0)
local nonce = ARGV[2] or bad('ARGV[2] (nonce) is missing')
local idem_flag = ARGV[3 + 6 * n]
if idem_flag ~= '0' and idem_flag ~= '1' then
  bad('ARGV[' .. (3 + 6 * n) .. '] (idempotency flag) must be "0" or "1", got '
      .. tostring(idem_flag))
end
local idem = idem_flag == '1'
local idem_key, fingerprint, owner, processing_ttl_ms
if idem then
  idem_key = KEYS[n + 1]
  fingerprint = ARGV[4 + 6 * n] or bad('fingerprint is missing')
  owner = ARGV[5 + 6 * n] or bad('owner token is missing')
  processing_ttl_ms = count_arg(6 + 6 * n, 1)
end
local L = (idem and 7 or 4) + 6 * n
local lease_flag = ARGV[L]
if lease_flag ~= nil and lease_flag ~= '0' and lease_flag ~= '1' then
  bad('ARGV[' .. L .. '] (lease flag) must be "0" or "1", got ' .. tostring(lease_flag))
end
local lease = lease_flag == '1'
if PEEK and (idem or lease) then
  bad('peek reads rate limits only: the idempotency and lease sections must be off')
end
local lease_key, fence_key, lease_owner, lease_ttl_ms, fence_ttl_ms
if lease then
  lease_key = KEYS[n + (idem and 1 or 0) + 1]
  fence_key = KEYS[n + (idem and 1 or 0) + 2]
  lease_owner = ARGV[L + 1]
  if lease_owner == nil or lease_owner == '' then
    bad('ARGV[' .. (L + 1) .. '] (lease owner) is missing')
  end
  lease_ttl_ms = count_arg(L + 2, 1)
  fence_ttl_ms = count_arg(L + 3, 1)
end

-- Every limit's arguments, validated before anything is read or written. A calendar limit's
-- zone, read once here, goes to cal[i] (cal: nil when the call has none).
local need_time = lease
local has_cc = false
local cal
for i = 1, n do
  local a = 3 + (i - 1) * 6
  local algo = ARGV[a]
  if algo ~= 'fw' and algo ~= 'lq' and algo ~= 'sw' and algo ~= 'sl' and algo ~= 'tb'
      and algo ~= 'cc' then
    bad('unknown algo ' .. tostring(algo))
  end
  count_arg(a + 1, 1) -- limit
  if (algo == 'fw' or algo == 'lq') and not tonumber(ARGV[a + 2]) then
    cal = cal or {}
    cal[i] = calendar_zone(ARGV[a + 2]) -- piece_calendar.lua
      or bad('ARGV[' .. (a + 2) .. '] (window) must be an integer >= 1 or a calendar spec, got '
        .. tostring(ARGV[a + 2]))
    need_time = true
  else
    count_arg(a + 2, 1) -- window_ms
  end
  count_arg(a + 3, 1) -- burst
  if ARGV[a + 4] ~= '0' and ARGV[a + 4] ~= '1' then
    bad('ARGV[' .. (a + 4) .. '] (shadow) must be "0" or "1", got ' .. tostring(ARGV[a + 4]))
  end
  local c = count_arg(a + 5, 0) -- cost
  if algo == 'cc' then
    if c ~= 1 then bad('ARGV[' .. (a + 5) .. '] (cost) of a concurrency limit must be 1') end
    has_cc = true
  end
  if algo ~= 'fw' and algo ~= 'lq' then need_time = true end
end

local nkeys = n + (idem and 1 or 0) + (lease and 2 or 0)
local cancel_key
if #KEYS == nkeys + 1 and (idem or lease or has_cc) then
  cancel_key = KEYS[nkeys + 1]
elseif #KEYS ~= nkeys then
  bad(#KEYS .. ' keys for ' .. n .. ' limits, idempotency ' .. (idem and 'on' or 'off')
      .. ', lease ' .. (lease and 'on' or 'off'))
end
if lease then
  for i = 1, nkeys - 2 do
    if KEYS[i] == lease_key or KEYS[i] == fence_key then bad('KEYS[' .. i .. '] is reused') end
  end
  if lease_key == fence_key then bad('the lease key and the fence key are the same') end
end
if cancel_key then
  for i = 1, nkeys do
    if KEYS[i] == cancel_key then bad('the cancellation marker is KEYS[' .. i .. '] too') end
  end
end

-- Redis TIME in µs, and the helpers of the sections that use it; all nil when none is on
-- (the idempotency section reads the clock itself, only when it creates a record).
local now, int, ms, retry_ms
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
if need_time or idem then
  -- Integer-valued string of a big double: tostring() would keep only 14 digits. '%d' says
  -- the same as '%.0f' for a whole number in [1, 2^53) and costs a third.
  int = function(x)
    if x >= 1 and x < 9007199254740992 and x % 1 == 0 then return string.format('%d', x) end
    return string.format('%.0f', x)
  end
end
local sw_wait
if need_time then
  now = clock()
  -- µs span -> whole ms, rounded up so waiting that long is always enough.
  ms = function(us) return math.max(0, math.ceil(us / 1000)) end
  retry_ms = function(us) return math.max(1, math.ceil(us / 1000)) end
  -- Sliding window: µs until the estimate leaves room for `need` units (it does not now).
  -- The estimate is prev, weighted by the share of it still inside the sliding window, plus
  -- cur; it falls while the current window runs (prev fades), then cur becomes prev and fades
  -- over the next window. `elapsed` and `left`: µs since the current window began and until
  -- it ends.
  sw_wait = function(limit, need, cur, prev, w, elapsed, left)
    local room = limit - need - cur
    if room >= 0 then
      -- cur fits: wait until prev's weighted share decays to room (before this window ends)
      return w * (1 - room / prev) - elapsed
    elseif limit >= need then
      -- cur alone is too high: in the next window cur becomes prev and decays from there
      return left + w * (1 - (limit - need) / cur)
    end
    return left + w -- need > limit never fits; the caller validates this away
  end
end

-- Phase 1: check every limit; nothing is written but the fw TTL repair (none with PEEK).
-- Limit i's verdict goes straight into its reply slots r .. r+3; what else phase 2 needs of
-- it (sw, sl, tb) goes to saved[2i-1] and saved[2i]. The reply is sized up front for the
-- usual single limit: growing a table rehashes it.
local reply, saved = n == 1 and { 1, 0, 0, 0, 0 } or { 1 }, {}
local admitted = true
for i = 1, n do
  local a, r, key = 3 + (i - 1) * 6, 2 + (i - 1) * 4, KEYS[i]
  local algo, limit, window_ms = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  -- need: what must fit for this request to be admitted (a cost of 0 needs one unit left)
  local cost = tonumber(ARGV[a + 5])
  local need = math.max(cost, 1)
  local ok, remaining, reset, retry

  if algo == 'fw' or algo == 'lq' then
    -- Fixed window: one counter; the window opens at its first consumption. Leased quota
    -- ("lq") is the same counter, consumed by slices (phase 2).
    local raw = redis.call('GET', key)
    local count = tonumber(raw) or 0
    ok = count + need <= limit
    remaining = math.max(0, limit - count)
    local zone = cal and cal[i]
    if zone then
      -- Calendar window: it ends with the period that holds now, counter or not. saved: that
      -- end (µs), for phase 2's TTL.
      local _, stop = calendar_period(zone, now) -- piece_calendar.lua
      reset = ms(stop - now)
      saved[2 * i - 1] = stop
      if raw and not PEEK and redis.call('PTTL', key) == -1 then
        redis.call('PEXPIRE', key, math.max(1, math.floor((stop - now) / 1000)))
      end
    else
      reset = window_ms -- no window open: GET found no counter, so no PTTL call (it says -2)
      if raw then
        local ttl = redis.call('PTTL', key)
        if ttl >= 0 then
          reset = ttl
        elseif ttl == -1 and not PEEK then
          redis.call('PEXPIRE', key, window_ms) -- without a TTL it would reject forever
        end
      end
    end
    retry = math.max(1, reset)

  elseif algo == 'sw' then
    -- Sliding window: counts of the current and previous aligned windows; the previous one is
    -- weighted by the share of it still inside the sliding window. Constant memory,
    -- approximate. reset_ms: when the estimate has dropped by one whole unit (remaining
    -- grows), 0 when it is 0; at most the end of the next window (a unit counted early in
    -- the current window comes back only as it fades there). Never more than 2 windows, the
    -- key's TTL. saved: cur, prev (after rolling over to the current window).
    local w, idx, cur, prev = window_roll(key, window_ms, now) -- piece_window_roll.lua
    local elapsed = now - idx * w
    local left = w - elapsed
    local est = prev * (1 - elapsed / w) + cur
    ok = est + need <= limit
    remaining = math.max(0, math.floor(limit - est))
    reset = 0
    if remaining < limit then
      reset = ms(sw_wait(limit, remaining + 1, cur, prev, w, elapsed, left))
    end
    if not ok then retry = retry_ms(sw_wait(limit, need, cur, prev, w, elapsed, left)) end
    saved[2 * i - 1], saved[2 * i] = cur, prev

  elseif algo == 'sl' then
    -- Sliding log: one ZSET member per unit, scored by its time in µs; an entry counts while
    -- score > now - window. Exact, memory grows with the limit. reset_ms: when the oldest
    -- entry in the window leaves it, 0 when the window is empty. saved: count, and the oldest
    -- entry's score (false when none).
    local w = window_ms * 1000
    local since = '(' .. int(now - w)
    local count = redis.call('ZCOUNT', key, since, '+inf')
    ok = count + need <= limit
    remaining = math.max(0, limit - count)
    reset = 0
    local oldest = false
    if count > 0 then
      -- The set's first entry is the oldest in the window unless it expired (every admission
      -- trims those, so that is rare): then the window's first is looked up.
      local e = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      oldest = tonumber(e[2])
      if oldest == nil or oldest <= now - w then
        e = redis.call('ZRANGEBYSCORE', key, since, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        oldest = tonumber(e[2])
      end
      reset = ms(oldest + w - now)
    end
    if not ok then
      -- the k oldest entries in the window have to leave; the k-th leaves at score + window
      local k = count + need - limit
      local wait = w -- need > limit never fits; the caller validates this away
      if k <= count then
        local e = redis.call('ZRANGEBYSCORE', key, since, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)
        wait = tonumber(e[2]) + w - now
      end
      retry = retry_ms(wait)
    end
    saved[2 * i - 1], saved[2 * i] = count, oldest

  elseif algo == 'cc' then
    -- Concurrency: a sorted set of the requests holding a slot (member: the nonce), each
    -- scored by the time its slot expires unless extended (µs); a slot counts while its score
    -- is ahead of now, so a crashed holder's slot frees itself. reset_ms: window_ms while a
    -- slot is held (an upper bound), else 0. retry_after: 1 s, since a slot frees when a
    -- request ends, which no clock says.
    local count = redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
    ok = count + 1 <= limit
    remaining = math.max(0, limit - count)
    reset = count > 0 and window_ms or 0
    retry = 1000

  else -- 'tb'
    -- Token bucket as GCRA: the key holds the theoretical arrival time (TAT, µs). A request is
    -- admitted while TAT after it is at most tau = burst * T ahead of now, T = window / limit.
    -- TAT is stored rounded to whole µs; a 1 µs tolerance keeps the verdict and `remaining`
    -- from disagreeing over that rounding. reset_ms: until the next token (the one that makes
    -- remaining + 1), 0 when the bucket is full. saved: the TAT after this request.
    local T = window_ms * 1000 / limit
    local burst = tonumber(ARGV[a + 3])
    local tau = T * burst
    local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
    local probe = tat + T * need
    ok = probe - tau <= now + 1
    remaining = math.min(burst, math.max(0, math.floor((tau - (tat - now) + 1) / T)))
    reset = 0
    if remaining < burst then reset = ms(tat - now - tau - 1 + (remaining + 1) * T) end
    if not ok then retry = retry_ms(probe - tau - now) end
    saved[2 * i - 1] = tat + T * cost
  end

  if not ok and ARGV[a + 4] == '0' then admitted = false end -- shadow limits never reject
  reply[r] = ok and 1 or 0
  reply[r + 1] = remaining
  reply[r + 2] = reset
  reply[r + 3] = ok and 0 or retry
end
if not admitted then reply[1] = 0 end

-- Cancelled by the filter (it gave up on this call before it ran): no concurrency slot is
-- taken and nothing is written for the record or the lease. The other rate limits are
-- counted as for any request that Redis saw. EXISTS only when the marker key was passed.
local cancelled = admitted and cancel_key ~= nil and redis.call('EXISTS', cancel_key) == 1

-- Phase 2: consume only if admitted, and only where this limit's own verdict is allow; the
-- reply's remaining and reset_ms then become the values after consumption. PEEK: never.
if admitted and not PEEK then
  for i = 1, n do
    local a, r, key = 3 + (i - 1) * 6, 2 + (i - 1) * 4, KEYS[i]
    local algo, limit, window_ms = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local cost = tonumber(ARGV[a + 5])

    if reply[r] == 0 then
      -- a shadow limit that rejects: phase 1's values stand

    elseif algo == 'cc' then
      if not cancelled then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now)) -- expired holders
        redis.call('ZADD', key, int(now + window_ms * 1000), nonce)
        redis.call('PEXPIRE', key, window_ms) -- every slot expires within window_ms
        reply[r + 1] = math.max(0, reply[r + 1] - 1)
        reply[r + 2] = window_ms
      end

    elseif cost == 0 then
      -- nothing to consume now: the response's charge counts (charge.lua)

    elseif algo == 'fw' or algo == 'lq' then
      -- INCRBY's argument: the string "1" as it came (the usual cost) spares redis.call
      -- formatting a number; any other cost goes as the number, which redis.call formats.
      local amount, arg = cost, ARGV[a + 5] == '1' and '1' or cost
      if algo == 'lq' then
        -- Leased quota: instead of one unit the caller takes a slice of what is left, admits
        -- this request from it and the rest locally. A slice never exceeds what is left, so
        -- all the slices of a window never exceed the limit; it is an eighth of what is left
        -- (at least `cost`), so slices shrink as the window fills and the units idle in
        -- other callers' slices when the counter runs out stay small.
        local left = reply[r + 1] -- limit - count: phase 1's remaining, exact as it allows
        amount = math.min(left, math.max(cost, math.floor(left / 8)))
        arg = amount
      end
      local c = redis.call('INCRBY', key, arg)
      if c == amount then -- a new window; a calendar one lives until its period ends
        local stop = cal and cal[i] and saved[2 * i - 1]
        redis.call('PEXPIRE', key, stop and math.max(1, math.floor((stop - now) / 1000))
          or window_ms)
      end
      reply[r + 1] = algo == 'lq' and amount or math.max(0, limit - c)
      -- reset_ms stands: INCRBY keeps the TTL

    elseif algo == 'sw' then
      local w, cur, prev = window_ms * 1000, saved[2 * i - 1], saved[2 * i]
      local idx = math.floor(now / w)
      local elapsed = now - idx * w
      local left = w - elapsed
      local est = prev * (1 - elapsed / w) + cur
      redis.call('HSET', key, 'w', int(idx), 'c', int(cur + cost), 'p', int(prev))
      redis.call('PEXPIRE', key, 2 * window_ms)
      local rest = math.max(0, math.floor(limit - est - cost))
      reply[r + 1] = rest
      -- cur + cost > 0 now: something is used, so remaining grows at some point
      reply[r + 2] = ms(sw_wait(limit, rest + 1, cur + cost, prev, w, elapsed, left))

    elseif algo == 'sl' then
      local w = window_ms * 1000
      redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - w))
      local args, score = {}, int(now)
      for u = 1, cost do
        args[#args + 1] = score
        args[#args + 1] = score .. ':' .. nonce .. ':' .. u
      end
      redis.call('ZADD', key, unpack(args))
      redis.call('PEXPIRE', key, window_ms)
      reply[r + 1] = math.max(0, limit - saved[2 * i - 1] - cost)
      -- the oldest entry in the window: phase 1's, else this request's own
      local oldest = saved[2 * i]
      reply[r + 2] = oldest and ms(oldest + w - now) or window_ms

    else -- 'tb'
      local T = window_ms * 1000 / limit
      local burst = tonumber(ARGV[a + 3])
      local tau = T * burst
      local new_tat = saved[2 * i - 1]
      local ahead = new_tat - now
      redis.call('SET', key, int(new_tat), 'PX', math.max(1, math.ceil(ahead / 1000)))
      local rest = math.min(burst, math.max(0, math.floor((tau - ahead + 1) / T)))
      reply[r + 1] = rest
      reply[r + 2] = rest < burst and ms(ahead - tau - 1 + (rest + 1) * T) or 0
    end
  end
end


-- Idempotency: create the PROCESSING record if absent, else report what is there.
local idem_code = 0
if idem and cancelled then
  idem_code = 6 -- CANCELLED
  reply[#reply + 1] = idem_code
  reply[#reply + 1] = redis.call('PTTL', idem_key)
  reply[#reply + 1] = ''
elseif idem then
  local SKIPPED, ACQUIRED, IN_PROGRESS, COMPLETED, CONFLICT, UNREADABLE = 0, 1, 2, 3, 4, 5
  local pttl, record = nil, ''
  idem_code = SKIPPED
  if admitted then
    -- One GET instead of TYPE + GET: absent reads as false, another type as an error table.
    local raw = redis.pcall('GET', idem_key)
    if raw == false then
      now = now or clock()
      local now_ms = int(math.floor(now / 1000))
      local rec = '{"schema_version":1,"state":"PROCESSING","fingerprint":'
        .. cjson.encode(fingerprint) .. ',"owner":' .. cjson.encode(owner)
        .. ',"created_ms":' .. now_ms .. ',"updated_ms":' .. now_ms .. '}'
      redis.call('SET', idem_key, rec, 'PX', int(processing_ttl_ms), 'NX')
      idem_code, pttl = ACQUIRED, processing_ttl_ms -- its PTTL: just set, no call needed
    elseif type(raw) ~= 'string' then
      idem_code = UNREADABLE
    else
      -- What complete.lua writes first: a COMPLETED record with this fingerprint is read as
      -- one without decoding the stored response it carries (the filter parses the record,
      -- and reads one it cannot as unreadable, as code 5 would say). Anything else is decoded.
      local head = '{"schema_version":1,"state":"COMPLETED","fingerprint":'
        .. cjson.encode(fingerprint) .. ',"created_ms":'
      if string.sub(raw, 1, #head) == head then
        idem_code, record = COMPLETED, raw
      else
        local decoded, rec = pcall(cjson.decode, raw)
        if not decoded or type(rec) ~= 'table' or type(rec.fingerprint) ~= 'string'
            or (rec.state ~= 'PROCESSING' and rec.state ~= 'COMPLETED') then
          idem_code = UNREADABLE
        elseif rec.fingerprint ~= fingerprint then
          idem_code = CONFLICT
        elseif rec.state == 'PROCESSING' then
          idem_code = IN_PROGRESS
        else
          idem_code, record = COMPLETED, raw
        end
      end
    end
  end
  reply[#reply + 1] = idem_code
  reply[#reply + 1] = pttl or redis.call('PTTL', idem_key)
  reply[#reply + 1] = record
end

-- Lease: SET NX PX with the owner token; a fencing token for every acquisition.
if lease then
  local SKIPPED, ACQUIRED, BUSY = 0, 1, 2
  local MAX_EXACT = 9007199254740992 -- 2^53
  local code, value = SKIPPED, 0
  if cancelled then
    code = 3 -- CANCELLED
  elseif admitted and (not idem or idem_code == 1) then -- 1: the record was ACQUIRED
    if redis.call('SET', lease_key, lease_owner, 'NX', 'PX', int(lease_ttl_ms)) then
      -- The last token issued under the fence key, 0 if it is absent or not one we wrote.
      -- One GET instead of TYPE + GET: another type's error table, like false, is no number.
      local last = tonumber(redis.pcall('GET', fence_key))
      if last == nil or last ~= math.floor(last) or last < 0 or last >= MAX_EXACT then
        last = 0
      end
      local token = int(math.max(last + 1, now))
      redis.call('SET', fence_key, token, 'PX', int(fence_ttl_ms))
      code, value = ACQUIRED, token
    else
      code, value = BUSY, math.max(1, redis.call('PTTL', lease_key))
    end
  end
  reply[#reply + 1] = code
  reply[#reply + 1] = value
end

-- Overrides: what each limit with override keys was counted with.
if ovr_reply then
  for j = 1, #ovr_reply do reply[#reply + 1] = ovr_reply[j] end
end
return reply
