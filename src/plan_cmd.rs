//! `pdkv plan`: pair a scenario's block lists and print the pairs.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use pdkv_core::exchange::{Pairing, PairingMode};
use pdkv_core::scenario::{Scenario, ScenarioFile};
use serde_json::json;

/// Arguments of `pdkv plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Scenario JSON file; `-` or nothing reads standard input.
    pub scenario: Option<PathBuf>,
    /// Print JSON (`{"groups": [{"pairs": [[remote, local], ...]}, ...]}`) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Override the scenario's pairing mode (`anchored` or `legacy`).
    #[arg(long)]
    pub pairing: Option<PairingModeArg>,
}

impl std::str::FromStr for PairingModeArg {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse::<PairingMode>()
            .map(PairingModeArg)
            .map_err(|error| error.to_string())
    }
}

/// clap needs `Clone + Send + Sync + 'static` parsing; `PairingMode` parses itself.
#[derive(Debug, Clone, Copy)]
pub struct PairingModeArg(pub PairingMode);

/// Runs `pdkv plan`; an impossible scenario exits non-zero (with `{"error": ...}` under `--json`).
pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    let outcome = load(&args).and_then(|scenario| {
        let pairing = scenario.run().context("pairing failed")?;
        Ok((scenario, pairing))
    });
    match (outcome, args.json) {
        (Ok((_, pairing)), true) => {
            crate::outln!("{}", pairing_json(&pairing));
            Ok(ExitCode::SUCCESS)
        }
        (Ok((scenario, pairing)), false) => {
            print!("{}", pairing_table(&scenario, &pairing));
            Ok(ExitCode::SUCCESS)
        }
        (Err(error), true) => {
            crate::outln!("{}", json!({ "error": crate::errors::render(&error) }));
            Ok(ExitCode::FAILURE)
        }
        (Err(error), false) => Err(error),
    }
}

/// Largest scenario read, from a file or standard input (64 MiB); a larger one is refused, never
/// cut silently.
pub const MAX_SCENARIO_BYTES: u64 = 64 << 20;

fn load(args: &PlanArgs) -> anyhow::Result<Scenario> {
    let from_stdin =
        || read_bounded(std::io::stdin().lock()).context("cannot read scenario from standard input");
    let (name, text) = match args.scenario.as_deref() {
        None => ("<stdin>".to_string(), from_stdin()?),
        Some(path) if path.as_os_str() == "-" => ("<stdin>".to_string(), from_stdin()?),
        Some(path) => {
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot read scenario {}", path.display()))?;
            let text =
                read_bounded(file).with_context(|| format!("cannot read scenario {}", path.display()))?;
            (path.display().to_string(), text)
        }
    };
    let mut scenario = parse_scenario(&name, &text)?;
    if let Some(PairingModeArg(mode)) = args.pairing {
        scenario.pairing = mode;
    }
    Ok(scenario)
}

/// Parses and checks one scenario from `text` (named `name` in errors, which give the JSON path
/// of what is wrong).
pub fn parse_scenario(name: &str, text: &str) -> anyhow::Result<Scenario> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let at = |error: serde_path_to_error::Error<serde_json::Error>| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if path == "." {
            anyhow::anyhow!("{name}: {inner}")
        } else {
            anyhow::anyhow!("{name}: {path}: {inner}")
        }
    };
    let file: ScenarioFile = serde_path_to_error::deserialize(&mut deserializer).map_err(at)?;
    // One scenario per input: anything after it (but white space) is a mistake, not ignored.
    deserializer
        .end()
        .map_err(|error| anyhow::anyhow!("{name}: after the scenario: {error}"))?;
    file.validate()
        .with_context(|| format!("{name}: invalid scenario"))
}

/// Reads all of `source` as UTF-8, refusing more than [`MAX_SCENARIO_BYTES`].
fn read_bounded(source: impl Read) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    source
        .take(MAX_SCENARIO_BYTES + 1)
        .read_to_end(&mut bytes)
        .context("read failed")?;
    if bytes.len() as u64 > MAX_SCENARIO_BYTES {
        anyhow::bail!(
            "scenario is larger than {MAX_SCENARIO_BYTES} bytes (64 MiB), the most pdkv plan reads"
        );
    }
    String::from_utf8(bytes).context("scenario is not UTF-8 text")
}

/// The `--json` shape: one object per group with its `[remote, local]` pairs.
pub fn pairing_json(pairing: &Pairing) -> serde_json::Value {
    let groups: Vec<_> = pairing
        .groups
        .iter()
        .map(|pairs| {
            let pairs: Vec<[u32; 2]> = pairs.iter().map(|pair| [pair.remote, pair.local]).collect();
            json!({ "pairs": pairs })
        })
        .collect();
    json!({ "groups": groups })
}

fn pairing_table(scenario: &Scenario, pairing: &Pairing) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let mode = match scenario.pairing {
        PairingMode::Anchored => "anchored",
        PairingMode::Legacy => "legacy",
    };
    let _ = writeln!(
        out,
        "{} prompt tokens, {} pairing",
        scenario.num_prompt_tokens, mode
    );
    for (group, (spec, pairs)) in scenario.layout.groups().iter().zip(&pairing.groups).enumerate() {
        let detail = match (spec.kind().window(), spec.kind().chunk()) {
            (Some(window), _) => format!("B={} W={}", spec.block_size(), window),
            (_, Some(chunk)) => format!("B={} C={}", spec.block_size(), chunk),
            _ if spec.kind().name() == "mamba" => "state".to_string(),
            _ => format!("B={} dcp={}", spec.block_size(), spec.dcp()),
        };
        let _ = writeln!(
            out,
            "group {group} ({}, {detail}): {} pairs",
            spec.kind().name(),
            pairs.len()
        );
        let _ = writeln!(
            out,
            "  {:>8} {:>8}  {:>8} {:>8}",
            "p_pos", "p_block", "d_pos", "d_block"
        );
        for pair in pairs {
            let marker = if pair.remote_position == pair.local_position {
                ""
            } else {
                "  <- shifted"
            };
            let _ = writeln!(
                out,
                "  {:>8} {:>8}  {:>8} {:>8}{marker}",
                pair.remote_position, pair.remote, pair.local_position, pair.local
            );
        }
    }
    out
}
