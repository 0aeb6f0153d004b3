//! `pdkv certs init` writes a CA and node certificates that really authenticate nodes to each
//! other over QUIC with mutual TLS.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pdkv_core::wire::NodeId;
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlLimits, ControlServer, ControlService, Hello, ServerSetup, TransportRuntime,
};
use pdkv_transport::tls::NodeIdentity;

struct Echo;

impl ControlService for Echo {
    type Request = String;
    type Response = String;

    fn handle(&self, peer: &NodeId, request: String) -> Result<String, String> {
        Ok(format!("{peer} said {request}"))
    }
}

fn hello(node: &str) -> Hello {
    Hello {
        node: NodeId(node.into()),
        role: "test".into(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: 7,
        engines: vec![],
    }
}

#[test]
fn certs_init_writes_certificates_that_authenticate_nodes() {
    let out = std::env::temp_dir().join(format!("pdkv-certs-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let pdkv = env!("CARGO_BIN_EXE_pdkv");
    let status = Command::new(pdkv)
        .args([
            "certs",
            "init",
            "--config",
            "cluster.toml",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    for file in [
        "ca.pem",
        "ca.key",
        "prefill-0.pem",
        "prefill-0.key",
        "decode-0.pem",
        "decode-0.key",
    ] {
        assert!(out.join(file).exists(), "{file} missing");
    }
    let mode = std::fs::metadata(out.join("decode-0.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "private keys are readable by their owner only");

    // A second init refuses to replace the CA without --force.
    let again = Command::new(pdkv)
        .args(["certs", "init", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("ca.key exists"));

    // The written certificates admit one node to the other.
    let runtime = TransportRuntime::new(2).unwrap();
    let prefill = NodeIdentity::load(&out, "prefill-0").unwrap();
    let decode = NodeIdentity::load(&out, "decode-0").unwrap();
    let setup = ServerSetup {
        cluster: vec![NodeId("prefill-0".into()), NodeId("decode-0".into())],
        hello: hello("prefill-0"),
        service: Arc::new(Echo),
        tickets: None,
        limits: ControlLimits::default(),
    };
    let server =
        ControlServer::start(&runtime.handle(), "127.0.0.1:0".parse().unwrap(), &prefill, setup).unwrap();
    let client = ControlClient::new(&runtime.handle(), "127.0.0.1:0".parse().unwrap(), &decode).unwrap();
    let address = server.local_addr().unwrap();
    let timeout = Duration::from_secs(5);
    let connection = runtime
        .block_on(client.connect(address, "prefill-0", &hello("decode-0"), timeout))
        .unwrap();
    let reply: String = runtime
        .block_on(connection.request("hi".to_string(), timeout))
        .unwrap();
    assert_eq!(reply, "decode-0 said hi");
    std::fs::remove_dir_all(&out).unwrap();
}
