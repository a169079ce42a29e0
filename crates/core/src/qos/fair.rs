//! Weighted max-min fairness (water-filling): how `total` is shared among
//! claimants that each want `demand` and weigh `weight`.
//!
//! The level `λ` is found such that every claimant gets `min(demand,
//! λ × weight)` and the parts add up to `total` (or everyone gets their
//! demand, when the demands add up to less). A claimant whose demand is
//! below its weighted part of what is left is *satisfied* and gets its
//! demand; the rest is divided again, by weight, among the others, until
//! no one is left capped. The stake QoS refill round uses it on predicted
//! demand; run summaries use it on offered rates, to say what each client's
//! fair share was.
//!
//! **Cost.** Each pass is one walk over the claimants; a pass either
//! settles the level or moves at least one claimant to the satisfied set,
//! so there are at most `n + 1` passes, and in practice two to four (the
//! set of satisfied claimants only grows). `level` stops after
//! `MAX_PASSES`, which leaves the level a little low (never too high: the
//! parts never add up to more than `total`).

/// Passes before `level` settles for what it has.
pub const MAX_PASSES: usize = 32;

/// One claimant: what it would use, and how much it weighs (its stake).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claim {
    pub demand: f64,
    pub weight: f64,
}

/// The water level `λ`: each claimant's part is `min(demand, λ × weight)`.
/// `f64::INFINITY` when the demands add up to `total` or less (everyone is
/// satisfied).
pub fn level(claims: &[Claim], total: f64) -> f64 {
    let demand: f64 = claims.iter().map(|c| c.demand.max(0.0)).sum();
    if demand <= total {
        return f64::INFINITY;
    }
    let mut lambda = 0.0;
    for _ in 0..MAX_PASSES {
        // Everyone under the current level is satisfied; the rest share
        // what is left by weight.
        let (mut satisfied, mut weight) = (0.0, 0.0);
        for c in claims {
            let d = c.demand.max(0.0);
            if d <= lambda * c.weight {
                satisfied += d;
            } else {
                weight += c.weight.max(0.0);
            }
        }
        if weight <= 0.0 {
            return lambda;
        }
        let next = (total - satisfied).max(0.0) / weight;
        if next <= lambda * (1.0 + 1e-12) {
            return next.max(lambda);
        }
        lambda = next;
    }
    lambda
}

/// Each claimant's part at `level`.
pub fn part(claim: &Claim, level: f64) -> f64 {
    let demand = claim.demand.max(0.0);
    if level.is_infinite() {
        demand
    } else {
        demand.min(level * claim.weight.max(0.0))
    }
}

/// Every claimant's part of `total`, in order.
pub fn shares(claims: &[Claim], total: f64) -> Vec<f64> {
    let level = level(claims, total);
    claims.iter().map(|c| part(c, level)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn claims(pairs: &[(f64, f64)]) -> Vec<Claim> {
        pairs
            .iter()
            .map(|&(demand, weight)| Claim { demand, weight })
            .collect()
    }

    #[test]
    fn everyone_floods_so_shares_follow_weight() {
        let got = shares(&claims(&[(100.0, 1.0), (100.0, 3.0)]), 40.0);
        assert_eq!(got, vec![10.0, 30.0]);
    }

    #[test]
    fn a_light_claimant_gets_its_demand_and_the_rest_goes_by_weight() {
        // The heavy staker wants 5 of its 30: the two others split 35 by
        // weight (1 : 2).
        let got = shares(&claims(&[(5.0, 3.0), (100.0, 1.0), (100.0, 2.0)]), 40.0);
        assert!((got[0] - 5.0).abs() < 1e-9, "{got:?}");
        assert!((got[1] - 35.0 / 3.0).abs() < 1e-9, "{got:?}");
        assert!((got[2] - 70.0 / 3.0).abs() < 1e-9, "{got:?}");
    }

    #[test]
    fn little_demand_leaves_everyone_satisfied() {
        assert_eq!(
            level(&claims(&[(1.0, 1.0), (2.0, 5.0)]), 10.0),
            f64::INFINITY
        );
        assert_eq!(
            shares(&claims(&[(1.0, 1.0), (2.0, 5.0)]), 10.0),
            vec![1.0, 2.0]
        );
    }

    #[test]
    fn idle_claimants_carry_no_weight() {
        let mut many = vec![(0.0, 1000.0); 1000];
        many.push((1000.0, 1000.0));
        let got = shares(&claims(&many), 8.0);
        assert!((got[1000] - 8.0).abs() < 1e-9, "{}", got[1000]);
    }

    /// Water-filling by the book: sort by demand per weight, satisfy in
    /// order while the next fits its weighted part of what is left.
    fn by_the_book(claims: &[Claim], total: f64) -> Vec<f64> {
        let mut order: Vec<usize> = (0..claims.len()).collect();
        order.sort_by(|&a, &b| {
            let ra = claims[a].demand / claims[a].weight;
            let rb = claims[b].demand / claims[b].weight;
            ra.partial_cmp(&rb).unwrap()
        });
        let mut out = vec![0.0; claims.len()];
        let (mut left, mut weight): (f64, f64) = (total, claims.iter().map(|c| c.weight).sum());
        for (k, &i) in order.iter().enumerate() {
            let c = claims[i];
            if c.demand <= left * c.weight / weight {
                out[i] = c.demand;
                left -= c.demand;
                weight -= c.weight;
            } else {
                for &j in &order[k..] {
                    out[j] = left * claims[j].weight / weight;
                }
                break;
            }
        }
        out
    }

    proptest! {
        /// For any demands and weights: the parts match water-filling by
        /// the book, never add up to more than the total, never give anyone
        /// more than it wants, and use the whole total when demand reaches it.
        #[test]
        fn matches_water_filling(
            pairs in proptest::collection::vec((0.0f64..1000.0, 1.0f64..1e7), 1..200),
            total in 1.0f64..10_000.0,
        ) {
            let claims = claims(&pairs);
            let got = shares(&claims, total);
            let expected = by_the_book(&claims, total);
            let sum: f64 = got.iter().sum();
            let demand: f64 = claims.iter().map(|c| c.demand).sum();
            prop_assert!(sum <= total * (1.0 + 1e-9) + 1e-9, "{sum} > {total}");
            prop_assert!((sum - demand.min(total)).abs() <= 1e-6 * total.max(1.0), "{sum} vs {}", demand.min(total));
            for ((g, e), c) in got.iter().zip(&expected).zip(&claims) {
                prop_assert!(*g <= c.demand + 1e-9);
                prop_assert!((g - e).abs() <= 1e-6 * total.max(1.0), "{g} vs {e}");
            }
        }
    }
}
