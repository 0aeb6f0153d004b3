//! pdkv's command-line program as a library: every subcommand's module, so the `pdkv` binary,
//! the benchmarks and the fuzz harness share one implementation.

pub mod admin;
pub mod certs_cmd;
pub mod chaos;
pub mod client;
pub mod errors;
pub mod fuzz;
pub mod gpus_cmd;
pub mod http;
pub mod launch;
pub mod launch_cmd;
pub mod lengths;
pub mod load_cmd;
pub mod node_cmd;
pub mod openai;
pub mod output;
pub mod plan_cmd;
pub mod render;
pub mod sim_cmd;
pub mod sweep_cmd;
pub mod vllm_leg;
pub mod vllm_router;
pub mod vllm_sweep;
