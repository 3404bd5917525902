
-- Appended to every scenario script by bench/run.py: one machine-readable line at the end.
-- setup() gives each thread its number as the global `bench_thread` (read by init()).
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("bench_thread", threads)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,' ..
    '"read_errors":%d,"write_errors":%d,"timeouts":%d,"non_2xx_3xx":%d,' ..
    '"latency_p50_us":%d,"latency_p90_us":%d,"latency_p99_us":%d,"latency_mean_us":%.1f,' ..
    '"latency_max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.timeout,
    e.status, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
