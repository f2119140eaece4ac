// Drives Stripe's Node SDK (pinned in package.json) through idemgate for tests/sdks.rs.
// Usage: node run.js SCENARIO, with IDEMGATE_PORT set. Prints one JSON line per call:
// {"call", "ok": true, "id"} or {"call", "ok": false, "class", "type", "code", "status"}.
'use strict';
const Stripe = require('stripe');

const stripe = new Stripe('sk_test_idemgate', {
  host: '127.0.0.1',
  port: Number(process.env.IDEMGATE_PORT),
  protocol: 'http',
  maxNetworkRetries: Number(process.env.MAX_RETRIES || '2'),
  telemetry: false,
});

async function call(name, params, key) {
  try {
    const pi = await stripe.paymentIntents.create(params, { idempotencyKey: key });
    return { call: name, ok: true, id: pi.id, amount: pi.amount };
  } catch (e) {
    return {
      call: name,
      ok: false,
      class: e.constructor.name,
      type: e.rawType || e.type,
      code: e.code,
      status: e.statusCode,
    };
  }
}

async function main() {
  const key = process.env.KEY;
  const scenario = process.argv[2];
  const out = [];
  if (scenario === 'mismatch') {
    out.push(await call('first', { amount: 1000, currency: 'usd' }, key));
    out.push(await call('other_amount', { amount: 2000, currency: 'usd' }, key));
  } else if (scenario === 'in_progress') {
    // The upstream takes its time with this amount; the second call arrives while the
    // first runs, is told to retry, and ends with the first's answer.
    const first = call('first', { amount: 4242, currency: 'usd' }, key);
    await new Promise((r) => setTimeout(r, 300));
    const second = call('concurrent', { amount: 4242, currency: 'usd' }, key);
    out.push(await first, await second);
  } else if (scenario === 'unknown') {
    // The upstream never answers this amount in time: 504, then 409 outcome-unknown.
    out.push(await call('first', { amount: 9999, currency: 'usd' }, key));
    out.push(await call('retry', { amount: 9999, currency: 'usd' }, key));
  } else {
    throw new Error(`unknown scenario ${scenario}`);
  }
  for (const o of out) console.log(JSON.stringify(o));
  // Kept-alive connections would hold the process open.
  process.exit(0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
