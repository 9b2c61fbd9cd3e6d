//! Loss-scaler sequences with expected values derived by hand from DeepSpeed's
//! `DynamicLossScaler.update_scale`.

use super::super::{DynamicLossScaler, LossScaler, LossScalerState, OptimError, StepOutcome};

/// Feeds `overflows` and returns the scale after each update.
fn scales(s: &mut DynamicLossScaler, overflows: &[bool]) -> Vec<f32> {
    overflows
        .iter()
        .map(|&o| {
            s.update(o).expect("update");
            s.scale()
        })
        .collect()
}

#[test]
fn hysteresis_delays_the_first_decrease_and_refills_only_on_growth() {
    // init 2^4 = 16, window 3, min 1, hysteresis 2.
    // it0 overflow: hysteresis 2→1, scale stays 16.   it1 overflow: 16→8, last_overflow = 1.
    // it2..4 clean: stable = 0,1,2 → nothing.          it5: stable 3 → ×2 = 16, hysteresis = 2.
    // it6,7 clean; it8: stable 6 → 32.                  it9 overflow: hysteresis 2→1, stays 32.
    // it10 clean: stable 0 (hysteresis NOT refilled).   it11 overflow: 32→16.
    let seq = [true, true, false, false, false, false, false, false, false, true, false, true];
    let want = [16., 8., 8., 8., 8., 16., 16., 16., 32., 32., 32., 16.];
    let mut s = DynamicLossScaler::new(4, 3, 1.0, 2).expect("scaler");
    assert_eq!(scales(&mut s, &seq), want);
    assert_eq!(s.state(), LossScalerState { cur_scale: 16.0, cur_iter: 12, last_overflow_iter: 11, cur_hysteresis: 1 });

    // With consecutive hysteresis the clean it10 refills it, so it11 only uses it up again.
    let mut c = DynamicLossScaler::new(4, 3, 1.0, 2).expect("scaler").with_consecutive_hysteresis(true);
    let got = scales(&mut c, &seq);
    assert_eq!(got[11], 32.0);
    assert_eq!(c.state().cur_hysteresis, 1);
}

#[test]
fn window_growth_skips_the_first_iteration() {
    // No overflow ever: stable interval at iteration i is i, growth when i > 0 and i % 2 == 0.
    let mut s = DynamicLossScaler::new(0, 2, 1.0, 2).expect("scaler");
    assert_eq!(scales(&mut s, &[false; 6]), [1., 1., 2., 2., 4., 4.]);
    let mut w1 = DynamicLossScaler::new(3, 1, 1.0, 1).expect("scaler");
    assert_eq!(scales(&mut w1, &[false; 4]), [8., 16., 32., 64.]);
}

#[test]
fn min_scale_floors_and_then_raises() {
    // 2^2 = 4 halves to max(2, 3) = 3; the next overflow at the floor is DeepSpeed's exception.
    let mut s = DynamicLossScaler::new(2, 1000, 3.0, 1).expect("scaler");
    assert_eq!(s.update(true), Ok(StepOutcome::SkippedOverflow { new_scale: 3.0 }));
    let err = s.update(true);
    assert_eq!(err, Err(OptimError::LossScaleAtMinimum { scale: 3.0, min_scale: 3.0 }));
    assert_eq!(s.state().cur_iter, 1, "a raising update changes nothing");

    let mut quiet = DynamicLossScaler::new(1, 1000, 1.0, 1).expect("scaler").with_raise_error_at_min_scale(false);
    assert_eq!(scales(&mut quiet, &[true, true, true]), [1., 1., 1.]);
}

#[test]
fn outcomes_and_static_scaler() {
    let mut d = LossScaler::Dynamic(DynamicLossScaler::default());
    assert_eq!(d.scale(), 65536.0);
    assert_eq!(d.update(false), Ok(StepOutcome::Applied));
    assert_eq!(d.update(true), Ok(StepOutcome::SkippedOverflow { new_scale: 65536.0 }));
    assert_eq!(d.update(true), Ok(StepOutcome::SkippedOverflow { new_scale: 32768.0 }));

    let mut s = LossScaler::Static(128.0);
    assert_eq!(s.update(true), Ok(StepOutcome::SkippedOverflow { new_scale: 128.0 }));
    assert_eq!(s.update(false), Ok(StepOutcome::Applied));
    assert_eq!(s.scale(), 128.0);
    assert!(!s.is_dynamic() && d.is_dynamic());
}

#[test]
fn state_round_trip_continues_identically() {
    let seq = [false, true, false, false, true, true, false, false, false, false];
    let mut a = DynamicLossScaler::new(10, 2, 1.0, 2).expect("scaler");
    scales(&mut a, &seq[..5]);
    let mut b = DynamicLossScaler::new(10, 2, 1.0, 2).expect("scaler");
    b.load_state(&a.state()).expect("load");
    assert_eq!(scales(&mut a, &seq[5..]), scales(&mut b, &seq[5..]));
    assert_eq!(a, b);

    let bad = [
        LossScalerState { cur_scale: 0.0, cur_iter: 3, last_overflow_iter: -1, cur_hysteresis: 1 },
        LossScalerState { cur_scale: 8.0, cur_iter: 3, last_overflow_iter: 3, cur_hysteresis: 1 },
        LossScalerState { cur_scale: 8.0, cur_iter: 3, last_overflow_iter: 1, cur_hysteresis: 3 },
    ];
    for st in bad {
        assert!(b.load_state(&st).is_err(), "{st:?} should be rejected");
    }
    let mut s = LossScaler::Static(1.0);
    s.load_state(&LossScalerState { cur_scale: 4.0, ..s.state() }).expect("static load");
    assert_eq!(s.scale(), 4.0);
}

#[test]
fn invalid_dynamic_config_is_rejected() {
    assert!(DynamicLossScaler::new(16, 0, 1.0, 2).is_err());
    assert!(DynamicLossScaler::new(16, 1000, 0.0, 2).is_err());
    assert!(DynamicLossScaler::new(16, 1000, 1.0, 0).is_err());
    assert!(DynamicLossScaler::new(128, 1000, 1.0, 2).is_err());
}
