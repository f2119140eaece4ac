//! The day's plan: seeded intents, each with how its client behaves. A pure function of
//! `(intents, seed)`.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// Accounts that start empty and never receive: every transfer out of them is refused by the
/// bank whatever the order of the day, so their outcome is known in advance.
const EMPTY_ACCOUNTS: usize = 2;
/// Share of intents that draw on an empty account.
const INSUFFICIENT_RATIO: f64 = 0.03;
/// The one day, in milliseconds.
const DAY_MS: u32 = 24 * 60 * 60 * 1000;

/// How a client sends one intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Behaviour {
    /// One request, waited for patiently.
    Plain,
    /// Gives up after `LabClient::timeout`, shorter than the bank's slow tail, and retries
    /// with the same key and body.
    TimeoutRetry,
    /// Writes the whole request on a raw socket, closes it without reading, then retries.
    DisconnectRetry,
    /// Two identical requests at the same instant.
    DoubleClick,
    /// Sends, gets the answer, then resends a corrected amount under the same key. The
    /// correction must be refused (422), never executed nor answered with the old transfer.
    TellerCorrection { corrected_amount: i64 },
}

impl Behaviour {
    /// A short name for tables and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            Behaviour::Plain => "plain",
            Behaviour::TimeoutRetry => "timeout_retry",
            Behaviour::DisconnectRetry => "disconnect_retry",
            Behaviour::DoubleClick => "double_click",
            Behaviour::TellerCorrection { .. } => "teller_correction",
        }
    }
}

/// One transfer somebody meant to make once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Intent {
    /// Position in the day, 0-based, in time order.
    pub seq: usize,
    /// Milliseconds since midnight; gives the day its order, not its pace.
    pub at_ms: u32,
    /// The key the client sends (prefixed per run, see [`LabClient::key_prefix`]).
    pub key: String,
    pub from: String,
    pub to: String,
    /// Minor units.
    pub amount: i64,
    pub behaviour: Behaviour,
    /// False for the designed insufficient-funds intents.
    pub should_succeed: bool,
}

/// The whole day: who has what in the morning, and what everyone meant to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DayPlan {
    pub seed: u64,
    /// Opening balances in minor units.
    pub opening: BTreeMap<String, i64>,
    pub intents: Vec<Intent>,
}

impl DayPlan {
    /// The day for `(intents, seed)`; the same arguments always give the same day.
    pub fn generate(intents: usize, seed: u64) -> DayPlan {
        let mut rng = StdRng::seed_from_u64(seed);
        let funded = (intents / 8).clamp(4, 400);
        let funded_ids: Vec<String> = (1..=funded).map(|i| format!("acc-{i:04}")).collect();
        let empty_ids: Vec<String> = (1..=EMPTY_ACCOUNTS)
            .map(|i| format!("acc-empty-{i}"))
            .collect();

        let mut drafts = Vec::with_capacity(intents);
        for _ in 0..intents {
            let at_ms = rng.random_range(0..DAY_MS);
            let to_index = rng.random_range(0..funded);
            let insufficient = rng.random_bool(INSUFFICIENT_RATIO);
            let from = if insufficient {
                empty_ids[rng.random_range(0..EMPTY_ACCOUNTS)].clone()
            } else {
                // Any funded account but the receiver.
                let pick = rng.random_range(0..funded - 1);
                funded_ids[if pick >= to_index { pick + 1 } else { pick }].clone()
            };
            // Mostly small payments, now and then a large one.
            let amount = if rng.random_bool(0.1) {
                rng.random_range(50_000..=500_000)
            } else {
                rng.random_range(100..=20_000)
            };
            let behaviour = match rng.random_range(0..100) {
                0..40 => Behaviour::Plain,
                40..65 => Behaviour::TimeoutRetry,
                65..80 => Behaviour::DisconnectRetry,
                80..90 => Behaviour::DoubleClick,
                _ => {
                    // A typo fixed: never the same amount, never zero.
                    let delta = rng.random_range(1..=amount.max(2) / 2);
                    let corrected_amount = if rng.random_bool(0.5) {
                        amount + delta
                    } else {
                        (amount - delta).max(1)
                    };
                    Behaviour::TellerCorrection { corrected_amount }
                }
            };
            drafts.push((
                at_ms,
                from,
                funded_ids[to_index].clone(),
                amount,
                behaviour,
                !insufficient,
            ));
        }
        // Stable sort: ties keep generation order, so the day stays a function of the seed.
        drafts.sort_by_key(|d| d.0);

        let intents: Vec<Intent> = drafts
            .into_iter()
            .enumerate()
            .map(
                |(seq, (at_ms, from, to, amount, behaviour, should_succeed))| Intent {
                    seq,
                    at_ms,
                    key: format!("tr-{seed:x}-{seq:06}"),
                    from,
                    to,
                    amount,
                    behaviour,
                    should_succeed,
                },
            )
            .collect();

        // Fund every account for several times what it could possibly send, corrections and
        // duplicates included, so that only the designed intents ever meet insufficient funds
        // and a duplicate in the direct run shows as money moved, not as a refusal.
        let mut outgoing: BTreeMap<&str, i64> = BTreeMap::new();
        for intent in intents.iter().filter(|i| i.should_succeed) {
            let corrected = match intent.behaviour {
                Behaviour::TellerCorrection { corrected_amount } => corrected_amount,
                _ => 0,
            };
            *outgoing.entry(intent.from.as_str()).or_default() += intent.amount + corrected;
        }
        let mut opening: BTreeMap<String, i64> = funded_ids
            .iter()
            .map(|id| {
                let out = outgoing.get(id.as_str()).copied().unwrap_or(0);
                (id.clone(), 1_000_000 + 6 * out)
            })
            .collect();
        opening.extend(empty_ids.into_iter().map(|id| (id, 0)));

        DayPlan {
            seed,
            opening,
            intents,
        }
    }

    /// Intents per behaviour name.
    pub fn mix(&self) -> BTreeMap<&'static str, usize> {
        let mut mix = BTreeMap::new();
        for intent in &self.intents {
            *mix.entry(intent.behaviour.name()).or_default() += 1;
        }
        mix
    }
}
