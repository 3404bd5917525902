-- tagged_head.lua and tagged_tail.lua: every script as the filter sends it is its body (its
-- own file, with the pieces it calls before it) between these two (src/redis/scripts/mod.rs).
--
-- ARGV[1] is the call's tag, 16 hex digits the filter makes for that call alone. The wrapper
-- takes it out of ARGV, so the body runs with the call's ARGV[2..] as its ARGV[1..], exactly
-- as it would alone (the ARGV of each script's header are the body's), and its reply carries
-- the tag back:
--
--   {tag, n, v1, ..., vn}   for the body's array reply of n values
--   {tag, -2, v}            for its integer reply v
--
-- The filter reads a reply as its call's only when it carries the call's tag: webdis can hand
-- a connection the reply of a command that another, closed, connection sent (src/redis/tag.rs).
-- An error the body raises is Redis's error reply, as without the wrapper, and carries no tag.
local TAG = table.remove(ARGV, 1) or error('a script call without its tag (ARGV[1])', 0)
local function body(KEYS, ARGV)
