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

/// ALPN protocol id of the Tessera transport.
pub const ALPN: &[u8] = b"tessera/1";

/// Why setting up certificates or TLS failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path}: a cluster CA already exists; refusing to overwrite it")]
    CaExists { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("node name {name:?} is not usable: {detail} (expected a DNS-style name such as node-0)")]
    BadName { name: String, detail: String },
    #[error("generating {what}: {detail}")]
    Generate { what: String, detail: String },
    #[error("{what}: no PEM {expected} found or it does not parse: {detail}")]
    Pem { what: String, expected: &'static str, detail: String },
    #[error("building the TLS config: {0}")]
    Tls(String),
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
    std::fs::write(path, text).map_err(|source| PkiError::Io { path: path.to_path_buf(), source })
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
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Io { path: dir.to_path_buf(), source })?;
    let ca_keys = generate("the CA key", KeyPair::generate())?;
    let mut params = generate("the CA parameters", CertificateParams::new(Vec::<String>::new()))?;
    params.distinguished_name.push(DnType::CommonName, "tessera cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca = generate("the CA certificate", params.self_signed(&ca_keys))?;
    let ca_key = dir.join("ca.key");
    write_new(&ca_key, &ca_keys.serialize_pem())?;
    let mut files = ClusterFiles { ca_cert: ca_cert.clone(), ca_key, nodes: Vec::new() };
    for name in nodes {
        let keys = generate(&format!("the key of {name}"), KeyPair::generate())?;
        let mut p = generate(&format!("the parameters of {name}"), CertificateParams::new(vec![name.to_string()]))?;
        p.distinguished_name.push(DnType::CommonName, *name);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = generate(&format!("the certificate of {name}"), p.signed_by(&keys, &ca, &ca_keys))?;
        let (cert_path, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        write_new(&cert_path, &cert.pem())?;
        write_new(&key_path, &keys.serialize_pem())?;
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
    std::fs::read_to_string(path).map_err(|source| PkiError::Io { path: path.to_path_buf(), source })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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

    /// TLS 1.3 server config that requires a client certificate signed by the cluster CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, PkiError> {
        let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider())
            .build()
            .map_err(|e| PkiError::Tls(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// TLS 1.3 client config that trusts only the cluster CA and presents this node's certificate.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, PkiError> {
        let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }
}

/// Checks that `cert` (already verified against the cluster CA by the handshake) was issued to
/// node `name`; returns a description of the mismatch otherwise.
pub fn check_cert_names_node(cert: &CertificateDer<'_>, name: &str) -> Result<(), String> {
    let server_name = ServerName::try_from(name).map_err(|e| format!("{name:?} is not a valid name: {e}"))?;
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| format!("peer certificate does not parse: {e}"))?;
    ee.verify_is_valid_for_subject_name(&server_name).map_err(|e| format!("peer certificate is not issued to {name:?}: {e}"))
}
