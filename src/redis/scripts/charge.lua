-- charge.lua: after the response, bring each counter to what the request really cost: the
-- difference between the charge the response reported and the cost consumed at admission is
-- added to the counter's current window (subtracted when negative, never below zero),
-- atomically for every limit of one hash slot.
--
-- KEYS[1..n]  rate-limit counters (as acquire.lua keeps them), n = ARGV[1] >= 1
-- ARGV[1]     n
-- ARGV[2 .. 1+4n]  four values per limit i, starting at ARGV[2 + (i-1)*4]:
--   algo       "fw" fixed_window | "sw" sliding_window | "tb" token_bucket
--   limit      integer > 0
--   window_ms  integer > 0; for fw also a calendar spec (piece_calendar.lua, as acquire.lua
--              takes it)
--   delta      integer (may be negative): charge - admitted cost
--
-- Reply: flat array of n integers: the units each counter really moved by (a negative delta
-- moves it at most down to zero; a counter whose window ended moves by 0 for a negative
-- delta).
--
-- Where the difference lands:
--   fw  the counter's current window; a positive delta opens a window (PX window_ms) if none
--       is open, so a request admitted at cost 0 still counts. A calendar window opened so
--       lives until the calendar period that holds Redis TIME ends, as acquire.lua's.
--   sw  the current aligned window's count (rolled over as acquire.lua does, by the same
--       window_roll: piece_window_roll.lua); the key is written only when that count moves,
--       so a negative delta never creates one.
--   tb  the theoretical arrival time moves by delta * (window / limit): never before now (a
--       full bucket); the key lives until the bucket is full again.
-- So a charge that arrives after the request's window ended counts in the window it arrives
-- in. Arguments are validated before anything is read or written.

local function bad(what) error('charge.lua: ' .. what, 0) end

local function int_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v % 1 ~= 0 or (min and v < min) or v ~= v or math.abs(v) == math.huge then
    bad('ARGV[' .. i .. '] must be an integer' .. (min and (' >= ' .. min) or '') .. ', got '
        .. tostring(ARGV[i]))
  end
  return v
end

local n = int_arg(1, 1)
if #KEYS ~= n then bad(#KEYS .. ' keys for ' .. n .. ' limits') end
local need_time = false
local cal -- cal[i]: limit i's calendar zone, for a fw limit with a calendar window
for i = 1, n do
  local a = 2 + (i - 1) * 4
  local algo = ARGV[a]
  if algo ~= 'fw' and algo ~= 'sw' and algo ~= 'tb' then bad('unknown algo ' .. tostring(algo)) end
  int_arg(a + 1, 1)
  if algo == 'fw' and not tonumber(ARGV[a + 2]) then
    cal = cal or {}
    cal[i] = calendar_zone(ARGV[a + 2]) -- piece_calendar.lua
      or bad('ARGV[' .. (a + 2) .. '] (window) must be an integer >= 1 or a calendar spec, got '
        .. tostring(ARGV[a + 2]))
    need_time = true
  else
    int_arg(a + 2, 1)
  end
  int_arg(a + 3)
  if algo ~= 'fw' then need_time = true end
end

local now
if need_time then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function int(x) return string.format('%.0f', x) end

local reply = {}
for i = 1, n do
  local a, key = 2 + (i - 1) * 4, KEYS[i]
  local algo, limit, window_ms = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local delta = tonumber(ARGV[a + 3])
  local moved = 0

  if delta == 0 then
    -- nothing to do
  elseif algo == 'fw' then
    local count = tonumber(redis.call('GET', key))
    if count == nil then
      if delta > 0 then
        local ttl = window_ms
        if cal and cal[i] then
          local _, stop = calendar_period(cal[i], now) -- piece_calendar.lua
          ttl = math.max(1, math.floor((stop - now) / 1000))
        end
        redis.call('SET', key, int(delta), 'PX', ttl)
        moved = delta
      end
    else
      moved = math.max(delta, -count)
      if moved ~= 0 then redis.call('INCRBY', key, int(moved)) end -- INCRBY keeps the TTL
    end

  elseif algo == 'sw' then
    local _, idx, cur, prev = window_roll(key, window_ms, now) -- piece_window_roll.lua
    moved = math.max(delta, -cur)
    if moved ~= 0 then -- else nothing to write: acquire.lua rolls the windows over itself
      redis.call('HSET', key, 'w', int(idx), 'c', int(cur + moved), 'p', int(prev))
      redis.call('PEXPIRE', key, 2 * window_ms)
    end

  else -- 'tb'
    local T = window_ms * 1000 / limit
    local stored = tonumber(redis.call('GET', key))
    local tat = math.max(stored or now, now)
    local new_tat = math.max(now, tat + T * delta)
    moved = math.floor((new_tat - tat) / T + 0.5)
    if new_tat > now then
      redis.call('SET', key, int(new_tat), 'PX', math.max(1, math.ceil((new_tat - now) / 1000)))
    elseif stored ~= nil then
      redis.call('DEL', key)
    end
  end
  reply[i] = moved
end
return reply
