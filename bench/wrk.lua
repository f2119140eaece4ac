-- Requests for bench/run. Arguments (after `--`): mode, prefix, keys.
--   none    POST without Idempotency-Key (direct upstream, or idemgate pass-through)
--   new     a key never used before on every request: prefix-<thread>-<n>
--   replay  cycles through prefix-0 .. prefix-<keys-1>, created beforehand
-- done() prints one line starting with BENCH, JSON, for bench/measure.py.

local body = '{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}'
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function init(args)
  mode = args[1] or "none"
  prefix = args[2] or "k"
  keys = tonumber(args[3] or "1")
  n = (tid or 1) * 7919 -- spread the threads over the replay keys
  headers = { ["Content-Type"] = "application/json" }
  if mode == "none" then
    fixed = wrk.format("POST", "/v1/transfers", headers, body)
  end
end

function request()
  if fixed then
    return fixed
  end
  n = n + 1
  if mode == "new" then
    headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. n
  else
    headers["Idempotency-Key"] = prefix .. "-" .. (n % keys)
  end
  return wrk.format("POST", "/v1/transfers", headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"socket_errors":%d,"non2xx":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
