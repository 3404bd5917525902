-- release.lua: give up the caller's PROCESSING record (the request failed before it had an
-- effect, so a retry may run it), atomically, only if the caller still owns it.
--
-- KEYS[1]  idempotency record
-- KEYS[2]  cancellation marker of the owner token, optional (same hash tag as KEYS[1]): when
--          given, the caller gave up on its acquire call, which may still run later; the
--          marker is set (SET PX ARGV[2], value "1") whatever the record's state, so that
--          acquire.lua, finding it, writes nothing. Set before the record is looked at.
-- ARGV[1]  owner token (the one acquire.lua stored)
-- ARGV[2]  marker_ttl_ms: integer > 0, required iff KEYS[2] is given
--
-- Reply: integer
--    1 RELEASED   the record was PROCESSING with this owner: deleted
--    0 MISSING    no record
--   -1 NOT_OWNER  anything else: another owner, COMPLETED, not a record we can read;
--                 untouched

local function bad(what) error('release.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (record) is missing')
local owner = ARGV[1] or bad('ARGV[1] (owner) is missing')

local RELEASED, MISSING, NOT_OWNER = 1, 0, -1

-- The marker, if KEYS[2] is given (piece_cancel_marker.lua, before this file).
set_cancel_marker(bad, key, 'record')

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind == 'none' then return MISSING end
if kind ~= 'string' then return NOT_OWNER end

-- Readable as acquire.lua reads it (a string fingerprint), PROCESSING, and ours.
local read, rec = pcall(cjson.decode, redis.call('GET', key))
if not read or type(rec) ~= 'table' or type(rec.fingerprint) ~= 'string'
    or rec.state ~= 'PROCESSING' or rec.owner ~= owner then
  return NOT_OWNER
end
redis.call('DEL', key)
return RELEASED
