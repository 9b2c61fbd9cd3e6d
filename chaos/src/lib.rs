//! tessera-chaos: seeded fault plans, injectors and invariant checkers.
