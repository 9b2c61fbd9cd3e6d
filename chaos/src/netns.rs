//! Test hosts in network namespaces: `TestNet::new(n)` makes `n` namespaces, each with one veth
//! interface on a shared bridge and its own IPv4 address, so processes started with
//! [`TestNet::command`] talk over a real (virtual) network. Links can be cut
//! ([`TestNet::set_link`]) and throttled ([`TestNet::throttle`], `tc … tbf`). Everything is
//! removed on drop. Needs root and iproute2; [`TestNet::new`] says why when it cannot.

use std::net::Ipv4Addr;
use std::process::Command;

/// Namespaces and links of one test network.
pub struct TestNet {
    prefix: String,
    hosts: usize,
    subnet: u8,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("running ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl TestNet {
    /// Creates `hosts` namespaces on one bridge. `subnet` picks 10.231.<subnet>.0/24 (use a
    /// different one per concurrent test).
    pub fn new(hosts: usize, subnet: u8) -> Result<TestNet, String> {
        let prefix = format!("tsr{}s{subnet}", std::process::id());
        let net = TestNet { prefix, hosts, subnet };
        // On error `net` is dropped here, which removes whatever was made.
        net.build()?;
        Ok(net)
    }

    fn bridge_ns(&self) -> String {
        format!("{}br", self.prefix)
    }

    /// The namespace of host `i`.
    pub fn host_ns(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    /// The address of host `i`.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.subnet, 1 + i as u8)
    }

    fn build(&self) -> Result<(), String> {
        let br = self.bridge_ns();
        ip(&["netns", "add", &br])?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for i in 0..self.hosts {
            let ns = self.host_ns(i);
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let (inner, outer) = ("eth0".to_string(), format!("v{i}"));
            ip(&["-n", &ns, "link", "add", &inner, "type", "veth", "peer", "name", &outer, "netns", &br])?;
            ip(&["-n", &br, "link", "set", &outer, "master", "br0"])?;
            ip(&["-n", &br, "link", "set", &outer, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", self.addr(i)), "dev", &inner])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
        }
        Ok(())
    }

    /// A command that runs `program` inside host `i`'s namespace.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host_ns(i), program]);
        c
    }

    /// Brings host `i`'s link up or down (a cut cable).
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        ip(&["-n", &self.host_ns(i), "link", "set", "eth0", if up { "up" } else { "down" }])
    }

    /// Caps host `i`'s egress with a token bucket (`tc qdisc … tbf`).
    pub fn throttle(&self, i: usize, rate_mbit: u32) -> Result<(), String> {
        let rate = format!("{rate_mbit}mbit");
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.host_ns(i),
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                &rate,
                "burst",
                "256kb",
                "latency",
                "400ms",
            ])
            .output()
            .map_err(|e| format!("running tc: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("tc tbf failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for i in 0..self.hosts {
            let _ = ip(&["netns", "del", &self.host_ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.bridge_ns()]);
    }
}
