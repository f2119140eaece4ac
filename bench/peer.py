#!/usr/bin/env python3
"""The measuring half of bench/peer (which starts the processes and passes their ports and
pids in the environment): new keys and replays through idemgate and through
idempotent-proxy-server, interleaved round after round; prints the medians, the ratios
taken within each round, and writes JSON."""

import http.client
import json
import os
import statistics
import subprocess
import sys
import time

ENV = os.environ
DURATION = int(ENV["BENCH_DURATION"])
ROUNDS = int(ENV["BENCH_ROUNDS"])
CONNECTIONS = int(ENV["BENCH_CONNECTIONS"])
OUT = ENV["BENCH_OUT"]
LUA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrk.lua")
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPLAY_KEYS = 256
RUN_ID = str(int(time.time()))
PIDS = {
    "idemgate": int(ENV["PID_IDEMGATE"]),
    "peer": int(ENV["PID_PEER"]),
    "idemgate_h2c": int(ENV["PID_IDEMGATE_H2C"]),
    "upstream": int(ENV["PID_UPSTREAM"]),
    "redis": int(ENV["PID_REDIS"]),
}
# proxy -> (port, the path its requests take to the upstream's /v1/transfers)
PROXIES = {
    "idemgate": (int(ENV["PORT_IDEMGATE"]), "/v1/transfers"),
    "peer": (int(ENV["PORT_PEER"]), "/URL_BENCH"),
    # idemgate with an h2c upstream: protected requests on pooled connections.
    "idemgate_h2c": (int(ENV["PORT_IDEMGATE_H2C"]), "/v1/transfers"),
}
IDEMGATES = ("idemgate", "idemgate_h2c")
CASES = [(proxy, mode) for mode in ("new", "replay") for proxy in PROXIES]
BODY = '{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}'


def cpu_seconds(pid):
    """utime + stime of all the process's threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def create_replay_keys(proxy):
    port, path = PROXIES[proxy]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for i in range(REPLAY_KEYS):
        conn.request("POST", path, BODY, {
            "Content-Type": "application/json",
            "Idempotency-Key": f"{RUN_ID}-{proxy}-replay-{i}",
        })
        res = conn.getresponse()
        res.read()
        if res.status != 201:
            sys.exit(f"{proxy}: creating replay key {i}: status {res.status}")


def run(proxy, mode, duration):
    port, path = PROXIES[proxy]
    prefix = (f"{RUN_ID}-{proxy}-replay" if mode == "replay"
              else f"{RUN_ID}-{proxy}-{time.monotonic_ns()}")
    threads = 1 if CONNECTIONS == 1 else 2
    cmd = ["wrk", f"-t{threads}", f"-c{CONNECTIONS}", f"-d{duration}s", "--timeout", "5s",
           "-s", LUA, f"http://127.0.0.1:{port}", "--", mode, prefix, str(REPLAY_KEYS), path]
    before = {p: cpu_seconds(pid) for p, pid in PIDS.items()}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    after = {p: cpu_seconds(pid) for p, pid in PIDS.items()}
    r = json.loads(next(l for l in out.splitlines() if l.startswith("BENCH "))[len("BENCH "):])
    n = max(r["requests"], 1)
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    r["cpu_us_per_request"] = {p: (after[p] - before[p]) * 1e6 / n for p in PIDS}
    if r["non2xx"] or r["socket_errors"]:
        print(f"  warning: {proxy} {mode}: {r['non2xx']} non-2xx, "
              f"{r['socket_errors']} socket errors", file=sys.stderr)
    return r


def main():
    for proxy in PROXIES:
        create_replay_keys(proxy)
    for proxy, mode in CASES:
        run(proxy, mode, 1)
    runs = {case: [] for case in CASES}
    for rnd in range(ROUNDS):
        for case in CASES:
            r = run(*case, DURATION)
            runs[case].append(r)
            print(f"round {rnd + 1}/{ROUNDS} {case[0]:>8} {case[1]:<6} {r['rps']:8.0f} req/s "
                  f"{r['cpu_us_per_request'][case[0]]:6.1f} us/req", file=sys.stderr)

    def med(case, f):
        return statistics.median(f(r) for r in runs[case])

    lines = [f"{CONNECTIONS} connections, {ROUNDS} rounds of {DURATION} s, medians",
             f"{'proxy':<13} {'case':<8} {'req/s':>8} {'p50 us':>7} {'p99 us':>7} "
             f"{'cpu us/req: proxy':>18} {'upstream':>8} {'redis':>6} {'errors':>6}"]
    for proxy, mode in CASES:
        case = (proxy, mode)
        errors = sum(r["non2xx"] + r["socket_errors"] for r in runs[case])
        lines.append(f"{proxy:<13} {mode:<8} {med(case, lambda r: r['rps']):8.0f} "
                     f"{med(case, lambda r: r['p50_us']):7.0f} {med(case, lambda r: r['p99_us']):7.0f} "
                     f"{med(case, lambda r: r['cpu_us_per_request'][proxy]):18.1f} "
                     f"{med(case, lambda r: r['cpu_us_per_request']['upstream']):8.1f} "
                     f"{med(case, lambda r: r['cpu_us_per_request']['redis']):6.1f} {errors:6d}")
    ratios = {}
    for name in IDEMGATES:
        for mode in ("new", "replay"):
            ig, peer = runs[(name, mode)], runs[("peer", mode)]
            # Requests per CPU second of the proxy, idemgate over the peer, within each round.
            ratio = {
                "per_cpu_second": statistics.median(
                    p["cpu_us_per_request"]["peer"] / i["cpu_us_per_request"][name]
                    for i, p in zip(ig, peer)),
                "rps": statistics.median(i["rps"] / p["rps"] for i, p in zip(ig, peer)),
                "redis_cpu": statistics.median(
                    i["cpu_us_per_request"]["redis"] / p["cpu_us_per_request"]["redis"]
                    for i, p in zip(ig, peer)),
            }
            ratios[f"{name}/{mode}"] = ratio
            lines.append(f"{name} / peer, {mode}: {ratio['per_cpu_second']:.2f}x requests "
                         f"per CPU second of the proxy, {ratio['rps']:.2f}x req/s, "
                         f"{ratio['redis_cpu']:.2f}x Redis CPU per request")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"runs": {f"{p}/{m}": v for (p, m), v in runs.items()}, "ratios": ratios,
                   "table": table}, f, indent=2)


if __name__ == "__main__":
    main()
