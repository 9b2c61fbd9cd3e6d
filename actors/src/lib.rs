//! tessera-actors: the supervisor tree and its actors; planners are pure code.
