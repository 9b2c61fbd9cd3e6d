//! The cluster's public-key infrastructure: a cluster CA made by [`cluster_init`], one
//! certificate per node name, and rustls configs that demand and verify mutual TLS.
//!
//! Files in the cluster directory (PEM): `ca.pem` (CA certificate), `ca.key` (CA private key,
//! kept so that the operator can later re-issue; nodes never read it), `<node>.pem` and
//! `<node>.key`. A node certificate carries the node name as its DNS subject-alternative name
//! and both server- and client-auth usages: every node is a TLS server (it accepts its higher
//! ranks) and a TLS client (it dials its lower ranks).

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// ALPN protocol id of the Tessera data plane (collectives, and the messages the engine sends
/// over them). Bumped whenever what ranks exchange changes layout, since the join check
/// compares only the package version: ranks of two builds then refuse to form a mesh instead
/// of misreading each other. (`/2`: the hellos agree on lanes and collectives declare receive
/// lanes. `/3`: the elastic replica step record (`engine::replica::StepRecord`, "RPL2") no
/// longer carries the owner's LAMB norm reductions.)
pub const ALPN: &[u8] = b"tessera/3";
/// ALPN protocol id of the control plane (driver ↔ workers and agents).
pub const ALPN_CONTROL: &[u8] = b"tessera-control/1";

/// Why setting up certificates or TLS failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path}: a cluster CA already exists; refusing to overwrite it")]
    CaExists { path: PathBuf },
    /// The I/O error is in the message, not a `source` (`{:#}` would print it twice).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("node name {name:?} is not usable: {detail} (expected a DNS-style name such as node-0)")]
    BadName { name: String, detail: String },
    #[error("generating {what}: {detail}")]
    Generate { what: String, detail: String },
    #[error("{what}: no PEM {expected} found or it does not parse: {detail}")]
    Pem { what: String, expected: &'static str, detail: String },
    #[error("building the TLS config: {0}")]
    Tls(String),
    #[error("not a join token: {detail} (expected tsr1-<secret>-<CA fingerprint>, as the coordinator prints it)")]
    Token { detail: String },
}

/// Paths written by [`cluster_init`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterFiles {
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    /// `(node name, certificate path, key path)` in the order given.
    pub nodes: Vec<(String, PathBuf, PathBuf)>,
}

fn generate<T>(what: &str, r: Result<T, rcgen::Error>) -> Result<T, PkiError> {
    r.map_err(|e| PkiError::Generate { what: what.to_string(), detail: e.to_string() })
}

fn check_name(name: &str) -> Result<(), PkiError> {
    let bad = |detail: &str| Err(PkiError::BadName { name: name.to_string(), detail: detail.to_string() });
    if name.is_empty() || name.len() > 63 {
        return bad("length must be 1..=63");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') || name.starts_with('-') {
        return bad("only ASCII letters, digits and inner '-' are allowed");
    }
    if name == "ca" {
        return bad("\"ca\" names the CA's own files");
    }
    Ok(())
}

fn write_new(path: &Path, text: &str) -> Result<(), PkiError> {
    std::fs::write(path, text).map_err(|err| PkiError::Io { path: path.to_path_buf(), err })
}

/// A private key (`cluster_init`'s, [`ClusterCa::issue_to_dir`]'s): readable by its owner only
/// (mode 0600, as the join-token file is), not by every user of the host.
fn write_key(path: &Path, text: &str) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |err| PkiError::Io { path: path.to_path_buf(), err };
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path).map_err(io)?;
    // A key file left by an interrupted run keeps its old mode through `open`.
    f.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

/// The CA certificate's parameters.
fn ca_params() -> Result<CertificateParams, PkiError> {
    let mut params = generate("the CA parameters", CertificateParams::new(Vec::<String>::new()))?;
    params.distinguished_name.push(DnType::CommonName, "tessera cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

/// A node certificate's parameters: the name as DNS SAN and common name, server and client use.
fn node_params(name: &str) -> Result<CertificateParams, PkiError> {
    let mut p = generate(&format!("the parameters of {name}"), CertificateParams::new(vec![name.to_string()]))?;
    p.distinguished_name.push(DnType::CommonName, name);
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    Ok(p)
}

/// Creates the cluster CA and one certificate + key per node in `dir` (created if missing).
/// Refuses to overwrite an existing `ca.pem`; node names must be distinct DNS labels.
pub fn cluster_init(dir: &Path, nodes: &[&str]) -> Result<ClusterFiles, PkiError> {
    for (i, name) in nodes.iter().enumerate() {
        check_name(name)?;
        if nodes[..i].contains(name) {
            return Err(PkiError::BadName { name: name.to_string(), detail: "listed twice".into() });
        }
    }
    let ca_cert = dir.join("ca.pem");
    if ca_cert.exists() {
        return Err(PkiError::CaExists { path: ca_cert });
    }
    std::fs::create_dir_all(dir).map_err(|err| PkiError::Io { path: dir.to_path_buf(), err })?;
    let ca_keys = generate("the CA key", KeyPair::generate())?;
    let ca = generate("the CA certificate", ca_params()?.self_signed(&ca_keys))?;
    let ca_key = dir.join("ca.key");
    write_key(&ca_key, &ca_keys.serialize_pem())?;
    let mut files = ClusterFiles { ca_cert: ca_cert.clone(), ca_key, nodes: Vec::new() };
    for name in nodes {
        let keys = generate(&format!("the key of {name}"), KeyPair::generate())?;
        let cert = generate(&format!("the certificate of {name}"), node_params(name)?.signed_by(&keys, &ca, &ca_keys))?;
        let (cert_path, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        write_new(&cert_path, &cert.pem())?;
        write_key(&key_path, &keys.serialize_pem())?;
        files.nodes.push((name.to_string(), cert_path, key_path));
    }
    // Written last: a partial run leaves no CA behind that would block a retry.
    write_new(&ca_cert, &ca.pem())?;
    Ok(files)
}

/// One node's TLS identity: the cluster CA it trusts and its own certificate and key.
#[derive(Debug)]
pub struct NodeTls {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl Clone for NodeTls {
    fn clone(&self) -> Self {
        NodeTls { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone_key() }
    }
}

fn read_text(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|err| PkiError::Io { path: path.to_path_buf(), err })
}

/// The variable that picks the TLS library's crypto: `aws-lc-rs` (the default) or `ring`.
pub const TLS_PROVIDER_ENV: &str = "TESSERA_TLS_PROVIDER";

/// The TLS crypto provider of [`TLS_PROVIDER_ENV`] (an error names a bad value), with TLS 1.3's
/// AES-128-GCM preferred (see [`provider_named`]).
fn provider() -> Result<Arc<rustls::crypto::CryptoProvider>, PkiError> {
    match std::env::var(TLS_PROVIDER_ENV) {
        Ok(v) => provider_named(v.trim()),
        Err(std::env::VarError::NotPresent) => provider_named("aws-lc-rs"),
        Err(std::env::VarError::NotUnicode(v)) => Err(PkiError::Tls(format!("{TLS_PROVIDER_ENV}={v:?}: expected aws-lc-rs or ring"))),
    }
}

/// The crypto provider `name` (`aws-lc-rs` or `ring`) with TLS 1.3's AES-128-GCM preferred over
/// AES-256-GCM, then ChaCha20-Poly1305 (both stay accepted).
///
/// Every byte of a QUIC connection is sealed and opened with the negotiated AEAD, so its speed
/// is a large part of the transport's CPU per byte. aws-lc-rs (rustls's default provider) seals
/// 64 KiB packets with AES-128-GCM ~2.3× as fast as ring on the 2-core dev box (24–26 against
/// 11–12 GB/s on one core, a scratch benchmark), and QUIC collectives cost 8–22 % less CPU per
/// call with it (docs/PERFORMANCE.md). AES-128 runs 10 rounds per block against AES-256's 14
/// (measured with ring: 2–5 % less CPU per collective); it is the suite every TLS 1.3
/// implementation must support (RFC 8446 §9.1) and the one QUIC's Initial packets use.
/// Both providers speak the same protocol: ranks may differ in their choice.
pub fn provider_named(name: &str) -> Result<Arc<rustls::crypto::CryptoProvider>, PkiError> {
    let p = match name {
        "aws-lc-rs" => {
            use rustls::crypto::aws_lc_rs::cipher_suite::{
                TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
            };
            let cipher_suites = vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
            rustls::crypto::CryptoProvider { cipher_suites, ..rustls::crypto::aws_lc_rs::default_provider() }
        }
        "ring" => {
            use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
            let cipher_suites = vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
            rustls::crypto::CryptoProvider { cipher_suites, ..rustls::crypto::ring::default_provider() }
        }
        other => return Err(PkiError::Tls(format!("{TLS_PROVIDER_ENV}={other:?}: expected aws-lc-rs or ring"))),
    };
    Ok(Arc::new(p))
}

impl NodeTls {
    /// Loads `ca.pem`, `<node>.pem` and `<node>.key` from a cluster directory.
    pub fn load(dir: &Path, node: &str) -> Result<Self, PkiError> {
        check_name(node)?;
        let ca = read_text(&dir.join("ca.pem"))?;
        let cert = read_text(&dir.join(format!("{node}.pem")))?;
        let key = read_text(&dir.join(format!("{node}.key")))?;
        Self::from_pem(&ca, &cert, &key)
    }

    /// Builds an identity from PEM texts (CA certificate, node certificate, node key).
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        let pem = |what: &str, expected, e: rustls::pki_types::pem::Error| PkiError::Pem {
            what: what.to_string(),
            expected,
            detail: e.to_string(),
        };
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| pem("CA", "certificate", e))?;
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| pem("node", "certificate", e))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| pem("node", "private key", e))?;
        Ok(NodeTls { ca, cert, key })
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, PkiError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(|e| PkiError::Tls(format!("the cluster CA is not a usable trust anchor: {e}")))?;
        Ok(Arc::new(roots))
    }

    /// TLS 1.3 server config of the data plane: requires a client certificate signed by the
    /// cluster CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, PkiError> {
        self.server_config_for(ALPN, ClientAuth::Required)
    }

    /// TLS 1.3 server config for protocol `alpn`. A client certificate, when presented, must be
    /// signed by the cluster CA; [`ClientAuth::Optional`] also admits clients without one (an
    /// agent that proves itself with a join token, see [`JoinToken`]). The chain sent includes
    /// the CA, so a client that pins the CA's fingerprint can verify it.
    pub fn server_config_for(&self, alpn: &[u8], auth: ClientAuth) -> Result<rustls::ServerConfig, PkiError> {
        self.server_config_with(alpn, auth, provider()?)
    }

    /// [`NodeTls::server_config_for`] with the crypto of `provider` ([`provider_named`]).
    pub fn server_config_with(
        &self,
        alpn: &[u8],
        auth: ClientAuth,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<rustls::ServerConfig, PkiError> {
        let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
        let builder = rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone());
        let builder = match auth {
            ClientAuth::Required => builder,
            ClientAuth::Optional => builder.allow_unauthenticated(),
        };
        let verifier = builder.build().map_err(|e| PkiError::Tls(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone(), self.ca.clone()], self.key.clone_key())
            .map_err(tls)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// TLS 1.3 client config of the data plane: trusts only the cluster CA and presents this
    /// node's certificate.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, PkiError> {
        self.client_config_for(ALPN)
    }

    /// As [`NodeTls::client_config`], for protocol `alpn`.
    pub fn client_config_for(&self, alpn: &[u8]) -> Result<rustls::ClientConfig, PkiError> {
        self.client_config_with(alpn, provider()?)
    }

    /// [`NodeTls::client_config_for`] with the crypto of `provider` ([`provider_named`]).
    pub fn client_config_with(&self, alpn: &[u8], provider: Arc<rustls::crypto::CryptoProvider>) -> Result<rustls::ClientConfig, PkiError> {
        let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// The cluster CA's certificate as PEM.
    pub fn ca_pem(&self) -> String {
        pem_text("CERTIFICATE", &self.ca)
    }

    /// SHA-256 of the cluster CA's certificate (DER), as a join token pins it.
    pub fn ca_sha256(&self) -> [u8; 32] {
        sha256(&self.ca)
    }
}

/// Whether a server demands a client certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Required,
    /// Clients without a certificate are admitted (they must then prove themselves otherwise);
    /// a certificate presented must still be the cluster CA's.
    Optional,
}

fn pem_text(label: &str, der: &[u8]) -> String {
    pem::encode(&pem::Pem::new(label, der.to_vec()))
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A cluster CA held in memory by a coordinator for the length of one run: it issues the
/// coordinator's own certificate and signs the certificates of agents that generated their
/// own keys ([`ClusterCa::sign_node_key`]); nothing of it is written to disk.
pub struct ClusterCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl ClusterCa {
    /// A fresh CA (ECDSA P-256).
    pub fn generate() -> Result<Self, PkiError> {
        let key = generate("the CA key", KeyPair::generate())?;
        let cert = generate("the CA certificate", ca_params()?.self_signed(&key))?;
        Ok(ClusterCa { cert, key })
    }

    /// The CA certificate as PEM.
    pub fn ca_pem(&self) -> String {
        self.cert.pem()
    }

    /// SHA-256 of the CA certificate (DER).
    pub fn ca_sha256(&self) -> [u8; 32] {
        sha256(self.cert.der())
    }

    /// A new key and a certificate for node `name` (e.g. the coordinator's own identity).
    pub fn issue(&self, name: &str) -> Result<NodeTls, PkiError> {
        check_name(name)?;
        let keys = generate(&format!("the key of {name}"), KeyPair::generate())?;
        let cert = generate(&format!("the certificate of {name}"), node_params(name)?.signed_by(&keys, &self.cert, &self.key))?;
        NodeTls::from_pem(&self.ca_pem(), &cert.pem(), &keys.serialize_pem())
    }

    /// Issues node `name` a new key and certificate and writes them, with the CA certificate,
    /// into `dir` (created if missing) as `ca.pem`, `<name>.pem` and `<name>.key` (the key
    /// with mode 0600): an identity [`NodeTls::load`] reads. The CA's own key is not written.
    /// For processes a driver starts on its own host; others generate their keys themselves
    /// ([`ClusterCa::sign_node_key`]).
    pub fn issue_to_dir(&self, dir: &Path, name: &str) -> Result<(), PkiError> {
        check_name(name)?;
        let keys = generate(&format!("the key of {name}"), KeyPair::generate())?;
        let cert = generate(&format!("the certificate of {name}"), node_params(name)?.signed_by(&keys, &self.cert, &self.key))?;
        std::fs::create_dir_all(dir).map_err(|err| PkiError::Io { path: dir.to_path_buf(), err })?;
        write_new(&dir.join("ca.pem"), &self.ca_pem())?;
        write_new(&dir.join(format!("{name}.pem")), &cert.pem())?;
        write_key(&dir.join(format!("{name}.key")), &keys.serialize_pem())
    }

    /// A certificate for node `name` over an ECDSA P-256 public key that the node generated
    /// itself (`public_key`: the uncompressed point, as [`NodeKey::public_key`] gives it); PEM.
    pub fn sign_node_key(&self, name: &str, public_key: &[u8]) -> Result<String, PkiError> {
        check_name(name)?;
        if public_key.len() != P256_POINT_BYTES || public_key[0] != 0x04 {
            let detail = format!("{} bytes (expected an uncompressed P-256 point of {P256_POINT_BYTES} bytes)", public_key.len());
            return Err(PkiError::Generate { what: format!("the certificate of {name}"), detail });
        }
        let key = RawP256(public_key.to_vec());
        let cert = generate(&format!("the certificate of {name}"), node_params(name)?.signed_by(&key, &self.cert, &self.key))?;
        Ok(cert.pem())
    }
}

/// Bytes of an uncompressed P-256 public key (0x04, x, y).
pub const P256_POINT_BYTES: usize = 65;

/// A public key received from a node, for rcgen to sign.
struct RawP256(Vec<u8>);

impl rcgen::PublicKeyData for RawP256 {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }
    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// A node's own key pair, generated where it runs: only its public half leaves the host.
pub struct NodeKey(KeyPair);

impl NodeKey {
    pub fn generate() -> Result<Self, PkiError> {
        Ok(NodeKey(generate("the node key", KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256))?))
    }

    /// The public key (uncompressed P-256 point) to have signed.
    pub fn public_key(&self) -> Vec<u8> {
        rcgen::PublicKeyData::der_bytes(&self.0).to_vec()
    }

    /// The identity made of this key, the certificate a CA signed for it and that CA.
    pub fn identity(&self, ca_pem: &str, cert_pem: &str) -> Result<NodeTls, PkiError> {
        NodeTls::from_pem(ca_pem, cert_pem, &self.0.serialize_pem())
    }
}

/// What a coordinator prints for agents that hold no certificate: a secret that admits them,
/// and the SHA-256 of the CA certificate they must find in the coordinator's TLS chain (so a
/// man in the middle cannot pose as the coordinator). Text form:
/// `tsr1-<32 hex digits of secret>-<64 hex digits of the CA's SHA-256>`.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub secret: [u8; 16],
    pub ca_sha256: [u8; 32],
}

impl std::fmt::Debug for JoinToken {
    /// Never prints the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinToken").field("ca_sha256", &hex(&self.ca_sha256)).finish_non_exhaustive()
    }
}

impl JoinToken {
    /// A new random secret for the CA with fingerprint `ca_sha256`.
    pub fn generate(ca_sha256: [u8; 32]) -> Result<Self, PkiError> {
        use ring::rand::SecureRandom;
        let mut secret = [0u8; 16];
        ring::rand::SystemRandom::new()
            .fill(&mut secret)
            .map_err(|_| PkiError::Generate { what: "the join token".into(), detail: "no system randomness".into() })?;
        Ok(JoinToken { secret, ca_sha256 })
    }

    /// The text form (see the type's doc).
    pub fn text(&self) -> String {
        format!("tsr1-{}-{}", hex(&self.secret), hex(&self.ca_sha256))
    }

    /// Parses the text form; the error says what is wrong (never echoing the secret).
    pub fn parse(text: &str) -> Result<Self, PkiError> {
        let bad = |detail: &str| PkiError::Token { detail: detail.to_string() };
        let mut parts = text.trim().split('-');
        if parts.next() != Some("tsr1") {
            return Err(bad("it does not start with `tsr1-`"));
        }
        let secret = parts.next().and_then(unhex::<16>).ok_or_else(|| bad("the secret is not 32 hex digits"))?;
        let ca_sha256 = parts.next().and_then(unhex::<32>).ok_or_else(|| bad("the CA fingerprint is not 64 hex digits"))?;
        if parts.next().is_some() {
            return Err(bad("it has more than three parts"));
        }
        Ok(JoinToken { secret, ca_sha256 })
    }

    /// Whether `secret` is this token's secret (constant time).
    pub fn admits(&self, secret: &[u8]) -> bool {
        secret.len() == self.secret.len() && secret.iter().zip(&self.secret).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// TLS 1.3 client config for protocol `alpn` without a client certificate that accepts the
    /// server only if its chain holds the CA this token pins and that CA signed the server's
    /// certificate for the name dialled.
    pub fn client_config(&self, alpn: &[u8]) -> Result<rustls::ClientConfig, PkiError> {
        let provider = provider()?;
        let verifier = Arc::new(PinnedCa { ca_sha256: self.ca_sha256, provider: provider.clone() });
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| PkiError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }
}

/// Verifies a server against the one CA certificate in its chain whose SHA-256 is pinned: the
/// full WebPKI check (signature chain, validity, name) with that CA as the only trust anchor.
#[derive(Debug)]
struct PinnedCa {
    ca_sha256: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
}

/// How a server whose CA is not the one a join token pins is refused (the start of the TLS
/// error): no retry can change that, so an agent that sees it stops dialling.
pub const NOT_THE_TOKENS_CA: &str = "the server's chain holds no CA with the join token's fingerprint";

impl rustls::client::danger::ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates.iter().find(|c| sha256(c) == self.ca_sha256) else {
            let detail = format!("{NOT_THE_TOKENS_CA} {}", hex(&self.ca_sha256));
            return Err(rustls::Error::General(detail));
        };
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone().into_owned()).map_err(|e| rustls::Error::General(format!("the pinned CA is not usable: {e}")))?;
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&self.provider))
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        webpki.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// Checks that `cert` (already verified against the cluster CA by the handshake) was issued to
/// node `name`; returns a description of the mismatch otherwise.
pub fn check_cert_names_node(cert: &CertificateDer<'_>, name: &str) -> Result<(), String> {
    let server_name = ServerName::try_from(name).map_err(|e| format!("{name:?} is not a valid name: {e}"))?;
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| format!("peer certificate does not parse: {e}"))?;
    ee.verify_is_valid_for_subject_name(&server_name).map_err(|e| format!("peer certificate is not issued to {name:?}: {e}"))
}
