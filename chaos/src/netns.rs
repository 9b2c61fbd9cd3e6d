//! Test hosts in network namespaces: `TestNet::new(n)` makes `n` namespaces, each with one veth
//! interface on a shared bridge and its own IPv4 address, so processes started with
//! [`TestNet::command`] talk over a real (virtual) network. Links can be cut
//! ([`TestNet::set_link`]) and throttled ([`TestNet::throttle`], `tc … tbf`). The test process
//! itself can join the network ([`TestNet::attach_root`]: a veth from the root namespace to the
//! bridge), e.g. to run a coordinator or a fault proxy in-process. Everything is removed on
//! drop. Needs root and iproute2; [`TestNet::new`] says why when it cannot.

use std::net::Ipv4Addr;
use std::process::Command;

/// Namespaces and links of one test network.
pub struct TestNet {
    prefix: String,
    hosts: usize,
    subnet: u8,
    /// The root namespace's veth onto the bridge, once attached.
    root_link: Option<String>,
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
        let net = TestNet { prefix, hosts, subnet, root_link: None };
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

    /// The root namespace's address on the bridge (after [`TestNet::attach_root`]).
    pub fn root_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.subnet, 254)
    }

    /// Connects the root namespace (this process) to the bridge at [`TestNet::root_addr`], so
    /// sockets of the test process reach the hosts and back. Removed on drop.
    pub fn attach_root(&mut self) -> Result<Ipv4Addr, String> {
        if self.root_link.is_some() {
            return Ok(self.root_addr());
        }
        let (br, name) = (self.bridge_ns(), format!("{}r", self.prefix));
        ip(&["link", "add", &name, "type", "veth", "peer", "name", "vroot", "netns", &br])?;
        self.root_link = Some(name.clone());
        ip(&["-n", &br, "link", "set", "vroot", "master", "br0"])?;
        ip(&["-n", &br, "link", "set", "vroot", "up"])?;
        ip(&["addr", "add", &format!("{}/24", self.root_addr()), "dev", &name])?;
        ip(&["link", "set", &name, "up"])?;
        Ok(self.root_addr())
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
        self.tc(i, &["qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", &rate, "burst", "256kb", "latency", "400ms"])
    }

    /// Removes host `i`'s bandwidth cap (back to the default queue).
    pub fn unthrottle(&self, i: usize) -> Result<(), String> {
        self.tc(i, &["qdisc", "del", "dev", "eth0", "root"])
    }

    fn tc(&self, i: usize, args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.host_ns(i), "tc"])
            .args(args)
            .output()
            .map_err(|e| format!("running tc: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("tc {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
        }
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        if let Some(name) = &self.root_link {
            let _ = ip(&["link", "del", name]);
        }
        for i in 0..self.hosts {
            let _ = ip(&["netns", "del", &self.host_ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.bridge_ns()]);
    }
}
