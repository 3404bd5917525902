-- complete.lua: turn the caller's PROCESSING record into COMPLETED, atomically, only if the
-- caller still owns it.
--
-- KEYS[1]  idempotency record
-- ARGV[1]  owner token (the one acquire.lua stored)
-- ARGV[2]  fingerprint ("sha256:<64 hex>")
-- ARGV[3]  completed_ttl_ms: integer > 0
-- ARGV[4]  response: a JSON object produced by the filter, e.g.
--          {"status":201,"headers":[["location","/o/1"]],"body":"..."}; stored verbatim
--
-- Reply: integer
--    1 COMPLETED  the record was PROCESSING with this owner and fingerprint; now COMPLETED
--    0 MISSING    no record (the processing lease expired); nothing written
--   -1 NOT_OWNER  a record exists but is not PROCESSING with this owner and fingerprint, or
--                 is not one we can read; nothing written
--
-- The COMPLETED record, compact JSON, TTL completed_ttl_ms; the owner is dropped:
--   {"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:..",
--    "created_ms":<from the PROCESSING record>,"updated_ms":<Redis TIME, ms>,"response":{..}}
-- It is built by concatenation so the response (up to ~100 KB) is not re-encoded, and
-- created_ms is copied as an exact integer. updated_ms is never below created_ms. A
-- PROCESSING record without a numeric created_ms (another writer) gets the completion time.
--
-- Arguments are validated before anything is read or written; a bad one is a script error.

local function bad(what) error('complete.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (record) is missing')
local owner = ARGV[1] or bad('ARGV[1] (owner) is missing')
local fingerprint = ARGV[2] or bad('ARGV[2] (fingerprint) is missing')
local ttl = tonumber(ARGV[3])
if ttl == nil or ttl ~= math.floor(ttl) or ttl < 1 or ttl == math.huge then
  bad('ARGV[3] (completed_ttl_ms) must be an integer >= 1, got ' .. tostring(ARGV[3]))
end
local response = ARGV[4] or bad('ARGV[4] (response) is missing')
-- The record must stay readable: the response has to be a JSON object.
local ok, decoded = pcall(cjson.decode, response)
if not ok or type(decoded) ~= 'table' or not string.find(response, '^%s*{') then
  bad('ARGV[4] (response) is not a JSON object')
end

-- Integer-valued string of a big double: tostring() would keep only 14 digits.
local function int(x) return string.format('%.0f', x) end

local MISSING, NOT_OWNER, COMPLETED = 0, -1, 1

-- One GET instead of TYPE + GET: absent reads as false, another type as an error table.
local raw = redis.pcall('GET', key)
if raw == false then return MISSING end
if type(raw) ~= 'string' then return NOT_OWNER end

-- The record exactly as acquire.lua writes it is read by pattern: its head, then its
-- created_ms and updated_ms. Any other value is decoded and read by its fields.
local encoded_fp = cjson.encode(fingerprint)
local head = '{"schema_version":1,"state":"PROCESSING","fingerprint":' .. encoded_fp
  .. ',"owner":' .. cjson.encode(owner) .. ',"created_ms":'
local created
if string.sub(raw, 1, #head) == head then
  created = tonumber(string.match(raw, '^(%d+),"updated_ms":%d+}$', #head + 1))
end
if created == nil then
  local read, rec = pcall(cjson.decode, raw)
  if not read or type(rec) ~= 'table' or rec.state ~= 'PROCESSING'
      or rec.owner ~= owner or rec.fingerprint ~= fingerprint then
    return NOT_OWNER
  end
  created = tonumber(rec.created_ms)
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if created == nil or created ~= math.floor(created) or created < 0 or created == math.huge then
  created = now_ms
end
local record = '{"schema_version":1,"state":"COMPLETED","fingerprint":' .. encoded_fp
  .. ',"created_ms":' .. int(created) .. ',"updated_ms":' .. int(math.max(now_ms, created))
  .. ',"response":' .. response .. '}'
redis.call('SET', key, record, 'PX', int(ttl))
return COMPLETED
