//! placeholder, filled in by this session
