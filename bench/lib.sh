# Shared by bench/run and bench/instructions (sourced, not run).

# Every benchmark's Redis is its own: no running instance to wait for before an idemgate
# makes the scope secret.
export IDEMGATE_SCOPE_SECRET_CREATE_DELAY=0s

# No walk of the whole store to count the records held unknown (every 5 minutes on each
# instance by default): its cost grows with the records kept, not with the requests
# measured, and a run of several idemgates on one Redis holding millions of records had
# the walks' SCAN and inspections land in whichever case was running (docs/performance.md
# measures the walk on its own).
export IDEMGATE_UNKNOWN_COUNT_INTERVAL=0s

# free_ports N: prints N free loopback ports, below the ephemeral range so that no outgoing
# connection (of this benchmark or anything else on the machine) takes one before its server
# binds it.
free_ports() {
  python3 -c '
import random, socket, sys
held = []
while len(held) < int(sys.argv[1]):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(20000, 32000)))
        held.append(s)
    except OSError:
        s.close()
ports = [s.getsockname()[1] for s in held]
for s in held:  # closed before the ports are printed: `read` may return before this exits
    s.close()
print(*ports, flush=True)' "$1"
}

# wait_for PORT WHAT [SECONDS]: waits until something accepts on PORT (10 s by default);
# exits the script if nothing does.
wait_for() {
  local tries=$(( ${3:-10} * 20 ))
  for _ in $(seq "$tries"); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "$(basename "$0"): $2 did not come up on port $1" >&2
  [ -n "${work:-}" ] && tail -n 5 "$work"/*.log >&2
  exit 1
}
