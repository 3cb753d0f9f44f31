//! PLACEHOLDER: replaced by the widgets branch.
//!
//! The live dashboard's view (issue 15): [`app::App`] turns snapshots into a ratatui frame and
//! keys into actions. The runtime that drives it (terminal, threads, restore) is
//! observe/dashboard.rs; it uses only the contract below (`Input`, `Action`, `App::new`,
//! `update`, `draw`, `key`).

pub mod app;
