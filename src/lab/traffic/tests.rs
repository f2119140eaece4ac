use std::collections::BTreeMap;

use super::*;

#[test]
fn the_same_seed_gives_the_same_day() {
    let a = DayPlan::generate(500, 42);
    let b = DayPlan::generate(500, 42);
    assert_eq!(a, b);
    let json_a = serde_json::to_string(&a).expect("serialize");
    let json_b = serde_json::to_string(&b).expect("serialize");
    assert_eq!(json_a, json_b);
}

#[test]
fn another_seed_gives_another_day() {
    let a = DayPlan::generate(500, 42);
    let b = DayPlan::generate(500, 43);
    assert_ne!(a.intents, b.intents);
}

#[test]
fn the_day_is_in_time_order_with_unique_keys_and_every_behaviour() {
    let plan = DayPlan::generate(1_000, 9);
    assert_eq!(plan.intents.len(), 1_000);
    assert!(plan.intents.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    let keys: std::collections::BTreeSet<_> = plan.intents.iter().map(|i| &i.key).collect();
    assert_eq!(keys.len(), 1_000);
    let mix = plan.mix();
    for name in [
        "plain",
        "timeout_retry",
        "disconnect_retry",
        "double_click",
        "teller_correction",
    ] {
        assert!(mix.get(name).copied().unwrap_or(0) > 20, "{name}: {mix:?}");
    }
    assert!(plan.intents.iter().any(|i| !i.should_succeed));
}

#[test]
fn corrections_change_the_amount_and_transfers_are_well_formed() {
    let plan = DayPlan::generate(1_000, 3);
    for intent in &plan.intents {
        assert_ne!(intent.from, intent.to);
        assert!(intent.amount > 0);
        assert!(plan.opening.contains_key(&intent.from));
        assert!(plan.opening.contains_key(&intent.to));
        if let Behaviour::TellerCorrection { corrected_amount } = intent.behaviour {
            assert!(corrected_amount > 0);
            assert_ne!(corrected_amount, intent.amount);
        }
    }
}

#[test]
fn only_the_designed_intents_can_run_out_of_money() {
    let plan = DayPlan::generate(2_000, 5);
    // Empty accounts never receive, so their intents fail in any order.
    for intent in &plan.intents {
        assert!(plan.opening[&intent.to] > 0, "{intent:?}");
        assert_eq!(intent.should_succeed, plan.opening[&intent.from] > 0);
    }
    // Funded accounts cover everything they might send, in any order.
    let mut worst: BTreeMap<&str, i64> = BTreeMap::new();
    for intent in plan.intents.iter().filter(|i| i.should_succeed) {
        *worst.entry(&intent.from).or_default() += intent.amount;
    }
    for (account, out) in worst {
        assert!(plan.opening[account] >= out, "{account}");
    }
}
