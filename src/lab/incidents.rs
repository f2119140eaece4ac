//! The bad day's incidents: what happens, and when, as positions in the day's intents.
//!
//! The schedule is a pure function of `(intents, seed)`, like the day itself, so the direct
//! run and the run through idemgate meet the same incidents at the same moments: an incident
//! fires as the day's clients reach its intent. Each moment is a share of the day, moved a
//! little by the seed; the stretch just before the retry storm is kept free of incidents,
//! since the storm's goodput is measured against it.
//!
//! Crates: `rand` (seeded) for the moments.

use std::ops::Range;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::bank::CloseAfterAnswer;

/// How long the store stays frozen.
pub const FREEZE: std::time::Duration = std::time::Duration::from_secs(2);

/// Something that happens at one moment of the day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The bank stops accepting, finishes what it has read, and listens again.
    BankRestart,
    /// The bank drops every connection, answered or not, and comes back.
    BankCrash,
    /// From here on the bank closes (or stops closing) each connection after its answer.
    CloseAfterAnswer(CloseAfterAnswer),
    /// An idemgate instance is SIGKILLed mid-request and replaced (shared stores only).
    InstanceKill,
    /// The store freezes for [`FREEZE`] (idemgate's runs only).
    StoreFreeze,
    /// The store restarts with its records kept (a `redis-server` the lab started itself,
    /// with persistence on; idemgate's runs only).
    StoreRestart,
}

/// The day's incidents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// (intent position, what happens), in day order.
    pub events: Vec<(usize, Event)>,
    /// Intents whose clients storm: [`super::traffic::STORM_COPIES`] copies at once.
    pub storm: Range<usize>,
    /// As many intents just before the storm, free of incidents: the storm's baseline.
    pub before_storm: Range<usize>,
    /// Intents whose clients read their answers slowly.
    pub slow_clients: Range<usize>,
    /// Where the bank closes connections after answering, with and without saying so.
    pub close_announced: Range<usize>,
    pub close_silent: Range<usize>,
}

impl Schedule {
    /// The incidents of the day of `intents` intents seeded with `seed`.
    pub fn generate(intents: usize, seed: u64) -> Schedule {
        // Its own stream, so the day's intents stay what `DayPlan::generate` makes them.
        let mut rng = StdRng::seed_from_u64(seed ^ 0xbad_da7);
        let mut at = |share: f64| -> usize {
            let moved = share + rng.random_range(-0.01..=0.01);
            ((moved * intents as f64) as usize).min(intents.saturating_sub(1))
        };
        let span = |start: usize, end: usize| start..end.max(start);
        let restarts = [at(0.08), at(0.92)];
        let crashes = [at(0.16), at(0.46), at(0.86)];
        let close_announced = span(at(0.22), at(0.30));
        let close_silent = span(close_announced.end, at(0.38));
        let store_restart = at(0.34);
        let kill = at(0.42);
        let freeze = at(0.50);
        let storm = span(at(0.66), at(0.74));
        let before_storm = storm.start.saturating_sub(storm.len())..storm.start;
        let slow_clients = span(at(0.78), at(0.84));

        let mut events: Vec<(usize, Event)> = restarts
            .iter()
            .map(|&s| (s, Event::BankRestart))
            .chain(crashes.iter().map(|&s| (s, Event::BankCrash)))
            .chain([
                (
                    close_announced.start,
                    Event::CloseAfterAnswer(CloseAfterAnswer::Announced),
                ),
                (
                    close_silent.start,
                    Event::CloseAfterAnswer(CloseAfterAnswer::Silent),
                ),
                (
                    close_silent.end,
                    Event::CloseAfterAnswer(CloseAfterAnswer::Never),
                ),
                (kill, Event::InstanceKill),
                (freeze, Event::StoreFreeze),
                (store_restart, Event::StoreRestart),
            ])
            .collect();
        events.sort_by_key(|(seq, _)| *seq);
        Schedule {
            events,
            storm,
            before_storm,
            slow_clients,
            close_announced,
            close_silent,
        }
    }

    /// Where in the day (percent of its intents) each `event` happens.
    pub fn moments(&self, event: Event, intents: usize) -> Vec<u32> {
        self.events
            .iter()
            .filter(|(_, e)| *e == event)
            .map(|(seq, _)| percent(*seq, intents))
            .collect()
    }
}

/// `seq` as a percentage of the day.
pub fn percent(seq: usize, intents: usize) -> u32 {
    (seq * 100 / intents.max(1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_incidents() {
        assert_eq!(Schedule::generate(1_000, 7), Schedule::generate(1_000, 7));
        assert_ne!(
            Schedule::generate(1_000, 7).events,
            Schedule::generate(1_000, 8).events
        );
    }

    #[test]
    fn every_incident_is_there_and_the_storms_baseline_is_quiet() {
        let s = Schedule::generate(1_000, 3);
        assert_eq!(s.moments(Event::BankCrash, 1_000).len(), 3);
        assert_eq!(s.moments(Event::BankRestart, 1_000).len(), 2);
        assert_eq!(s.moments(Event::InstanceKill, 1_000).len(), 1);
        assert_eq!(s.moments(Event::StoreFreeze, 1_000).len(), 1);
        assert_eq!(s.moments(Event::StoreRestart, 1_000).len(), 1);
        assert!(s.storm.len() > 50 && s.before_storm.len() == s.storm.len());
        assert!(!s.slow_clients.is_empty() && !s.close_silent.is_empty());
        for (seq, _) in &s.events {
            assert!(!s.before_storm.contains(seq) && !s.storm.contains(seq));
        }
    }
}
