-- piece_calendar.lua: the calendar period ("align": "calendar") that holds a moment, in a time
-- zone given by its offsets and POSIX TZ changes. Included by acquire.lua and charge.lua:
-- src/redis/scripts/mod.rs (Scripts::load) puts this file before each, so inside batch.lua it
-- is defined again in acquire_one and charge_one.
--
-- Expects in scope: no local of the script (it runs before the script's own text); it uses
-- only Lua's globals (string, math, tonumber, type). Adds two locals: calendar_zone and
-- calendar_period (their helpers are theirs, made only when a calendar limit calls them).
--
-- calendar_zone(spec) reads a limit's window argument: nil when it is not a calendar spec
-- (the caller then reads it as milliseconds), else a table of what calendar_period needs.
--   spec  '<period>@<zone>'
--         period  '1d' a day, from local midnight; '1w' a week, from Monday's local midnight
--                 (ISO 8601); '1mo' a month, from the local midnight that starts its 1st
--         zone    '<std>': a fixed offset, whole seconds east of UTC; or
--                 '<std>,<dst>,<start>,<end>': the standard and the daylight offset, and the
--                 changes to daylight time and back, each as a POSIX TZ rule writes its dates:
--                 'M<m>.<w>.<d>/<s>' (weekday d, 0 Sunday, of week w, 5 the last, of month m),
--                 'J<n>/<s>' (day n of 1-365, February 29 never counted) or '<n>/<s>' (day n
--                 of 0-365, February 29 counted), s the seconds after that day's local
--                 midnight in the offset in effect before the change (-167 h to 167 h)
--   The filter writes the spec (src/config/calendar.rs, Calendar::spec); each value is
--   checked here too, and a spec that is not one is an error the caller raises.
--
-- calendar_period(z, now_us) -> start_us, end_us: the period that holds now_us (Redis TIME in
-- µs). A period starts at the first moment the local clock reads its first day's midnight or
-- later: where a change skips that midnight (clocks set forward across it), at the change;
-- where the clock reads it twice (set back across it), at the first time, so the repeated
-- time belongs to the new period. Bounds are whole seconds, in µs. Days are counted from
-- 1970-01-01 in the proleptic Gregorian calendar (days_from_civil / civil_from_days: H.
-- Hinnant's algorithms), every value an integer-valued double, exact for any Redis TIME.
local function calendar_zone(spec)
  -- A change's date: kind 'M' (a = month, b = week, c = weekday), 'J' (a = day 1-365) or
  -- 'n' (a = day 0-365), and its time s.
  local function change(text)
    local m, w, d, s = string.match(text, '^M(%d%d?)%.(%d)%.(%d)/(%-?%d+)$')
    if m then
      m, w, d, s = tonumber(m), tonumber(w), tonumber(d), tonumber(s)
      if m >= 1 and m <= 12 and w >= 1 and w <= 5 and d <= 6 and math.abs(s) <= 601200 then
        return { 'M', m, w, d, s }
      end
      return nil
    end
    local kind, n
    kind, n, s = string.match(text, '^(J?)(%d%d?%d?)/(%-?%d+)$')
    n, s = tonumber(n), tonumber(s)
    if not n or math.abs(s) > 601200 then return nil end
    if kind == 'J' then
      if n >= 1 and n <= 365 then return { 'J', n, 0, 0, s } end
    elseif n <= 365 then
      return { 'n', n, 0, 0, s }
    end
    return nil
  end

  if type(spec) ~= 'string' then return nil end
  local period, zone = string.match(spec, '^(1[dwmo]+)@(.+)$')
  if period ~= '1d' and period ~= '1w' and period ~= '1mo' then return nil end
  local std = string.match(zone, '^(%-?%d+)$')
  local dst, on, off
  if not std then
    std, dst, on, off = string.match(zone, '^(%-?%d+),(%-?%d+),([^,]+),([^,]+)$')
  end
  std, dst = tonumber(std), tonumber(dst)
  if not std or math.abs(std) > 90000 or (dst and math.abs(dst) > 90000) then return nil end
  local z = { period = period, std = std }
  if dst then
    z.dst, z.start, z.stop = dst, change(on), change(off)
    if not (z.start and z.stop) then return nil end
  end
  return z
end

local function calendar_period(z, now_us)
  local floor = math.floor

  local function days_from_civil(y, m, d)
    if m <= 2 then y = y - 1 end
    local era = floor(y / 400)
    local yoe = y - era * 400
    local doy = floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
    local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
    return era * 146097 + doe - 719468
  end

  local function civil_from_days(days)
    days = days + 719468
    local era = floor(days / 146097)
    local doe = days - era * 146097
    local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
    local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
    local mp = floor((5 * doy + 2) / 153)
    local d = doy - floor((153 * mp + 2) / 5) + 1
    local m = mp < 10 and mp + 3 or mp - 9
    local y = yoe + era * 400
    if m <= 2 then y = y + 1 end
    return y, m, d
  end

  -- The day (days since 1970-01-01) a change falls on in year y.
  local function change_day(c, y)
    if c[1] == 'M' then
      local month, week, weekday = c[2], c[3], c[4]
      local first = days_from_civil(y, month, 1)
      local days = (month == 12 and days_from_civil(y + 1, 1, 1)
        or days_from_civil(y, month + 1, 1)) - first
      -- 1970-01-01 was a Thursday (4; Sunday is 0)
      local day = (weekday - (first + 4) % 7) % 7 + (week - 1) * 7
      while day >= days do day = day - 7 end -- week 5: the last such weekday
      return first + day
    elseif c[1] == 'J' then
      local n = c[2]
      if n >= 60 and ((y % 4 == 0 and y % 100 ~= 0) or y % 400 == 0) then
        n = n + 1 -- J60 is March 1 in every year
      end
      return days_from_civil(y, 1, 1) + n - 1
    end
    return days_from_civil(y, 1, 1) + c[2]
  end

  -- The moments (s since the epoch) of year y's change to daylight time and back.
  local function changes(y)
    local on = change_day(z.start, y) * 86400 + z.start[5] - z.std
    local off = change_day(z.stop, y) * 86400 + z.stop[5] - z.dst
    return on, off
  end

  -- The offset in effect at t (s since the epoch). The year is the one of standard local
  -- time; daylight time runs from its start to its end, across the year's end when it starts
  -- later in the year than it ends (the southern hemisphere, and a negative daylight saving).
  local function offset_at(t)
    if not z.dst then return z.std end
    local on, off = changes((civil_from_days(floor((t + z.std) / 86400))))
    if on < off then
      return (t >= on and t < off) and z.dst or z.std
    end
    return (t >= off and t < on) and z.std or z.dst
  end

  -- The first moment (s) the local clock reads `wall` (local seconds since the epoch) or
  -- later: the earlier of the instants that read it, else (a change skipped it) the change.
  local function first_reading(wall)
    local a, b = wall - z.std, wall - (z.dst or z.std)
    local lo, hi = math.min(a, b), math.max(a, b)
    if lo + offset_at(lo) == wall then return lo end
    if hi + offset_at(hi) == wall then return hi end
    local y = civil_from_days(floor(wall / 86400))
    for year = y - 1, y + 1 do
      local on, off = changes(year)
      if on > lo and on <= hi then return on end
      if off > lo and off <= hi then return off end
    end
    return hi -- not reached for a zone whose changes are months apart
  end

  -- The local midnights (days since the epoch) that start the period holding `day` and the
  -- next one.
  local function bounds(day)
    if z.period == '1d' then return day, day + 1 end
    if z.period == '1w' then
      local monday = day - (day + 3) % 7 -- 1970-01-01 was a Thursday
      return monday, monday + 7
    end
    local y, m = civil_from_days(day)
    local first = days_from_civil(y, m, 1)
    if m == 12 then return first, days_from_civil(y + 1, 1, 1) end
    return first, days_from_civil(y, m + 1, 1)
  end

  local t = floor(now_us / 1000000)
  local first, next_first = bounds(floor((t + offset_at(t)) / 86400))
  local start, stop = first_reading(first * 86400), first_reading(next_first * 86400)
  if t >= stop then
    -- the clock was set back across the period's end: the repeated time is the next period's
    first, next_first = bounds(next_first)
    start, stop = stop, first_reading(next_first * 86400)
  end
  return start * 1000000, stop * 1000000
end
