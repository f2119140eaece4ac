"""Drives Stripe's Python SDK (pinned in requirements.txt) through idemgate for tests/sdks.rs.

Usage: python3 run.py SCENARIO, with IDEMGATE_PORT and KEY set. Prints one JSON line per
call: {"call", "ok": true, "id"} or {"call", "ok": false, "class", "type", "code", "status"}.
"""
import json
import os
import sys
import threading
import time

import stripe

client = stripe.StripeClient(
    "sk_test_idemgate",
    base_addresses={"api": f"http://127.0.0.1:{os.environ['IDEMGATE_PORT']}"},
    max_network_retries=int(os.environ.get("MAX_RETRIES", "2")),
)


def call(name, amount, key):
    try:
        pi = client.v1.payment_intents.create(
            params={"amount": amount, "currency": "usd"},
            options={"idempotency_key": key},
        )
        return {"call": name, "ok": True, "id": pi.id, "amount": pi.amount}
    except stripe.StripeError as e:
        err = e.error
        return {
            "call": name,
            "ok": False,
            "class": type(e).__name__,
            "type": getattr(err, "type", None),
            "code": getattr(err, "code", None) or e.code,
            "status": e.http_status,
        }


def main():
    key = os.environ["KEY"]
    scenario = sys.argv[1]
    out = []
    if scenario == "mismatch":
        out.append(call("first", 1000, key))
        out.append(call("other_amount", 2000, key))
    elif scenario == "in_progress":
        results = {}
        t = threading.Thread(target=lambda: results.update(first=call("first", 4242, key)))
        t.start()
        time.sleep(0.3)
        second = call("concurrent", 4242, key)
        t.join()
        out += [results["first"], second]
    elif scenario == "unknown":
        out.append(call("first", 9999, key))
        out.append(call("retry", 9999, key))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    for o in out:
        print(json.dumps(o), flush=True)


main()
