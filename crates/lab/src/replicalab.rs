//! The replica-mode segment: a client and two servers on one hub-mode switch, both servers
//! holding the service address (issue 10 item 1).
//!
//! ```text
//!  client 10.77.3.2 ── lan (bridge br0, ageing 0: every unicast frame floods every port)
//!                        ├── primary 10.77.3.11 + service 10.77.3.10/32   02:77:03:00:00:11
//!                        └── backup  10.77.3.12 + service 10.77.3.10/32   02:77:03:00:00:12
//! ```
//!
//! The builder adds the service address to the primary only; a test installs the backup's ARP
//! suppression first and then calls [`ReplicaLab::add_backup_service_ip`], so the backup never
//! holds the address unsuppressed. Offloads stay on (the backup sees what a real segment
//! delivers). The lab is a [`Lab`]: dropping it, also while unwinding, deletes every namespace.

use std::io;

use crate::lab::{dev, Lab};

/// Addresses of the replica segment.
pub mod addr {
    use std::net::Ipv4Addr;
    pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 3, 2);
    pub const PRIMARY_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 3, 11);
    pub const BACKUP_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 3, 12);
    /// The service address both servers own.
    pub const SERVICE_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 3, 10);
    pub const CLIENT_MAC: [u8; 6] = [0x02, 0x77, 0x03, 0, 0, 0x02];
    pub const PRIMARY_MAC: [u8; 6] = [0x02, 0x77, 0x03, 0, 0, 0x11];
    pub const BACKUP_MAC: [u8; 6] = [0x02, 0x77, 0x03, 0, 0, 0x12];
}

/// The replica segment (see the module docs). Every host's only interface is [`dev::APP`]
/// (`eth0`).
#[derive(Debug)]
pub struct ReplicaLab {
    pub lab: Lab,
    pub client: String,
    pub primary: String,
    pub backup: String,
    /// The switch.
    pub lan: String,
}

impl ReplicaLab {
    /// Builds the segment; the switch is a hub.
    pub fn build() -> io::Result<ReplicaLab> {
        let mut lab = Lab::new();
        let client = lab.add_ns("client")?;
        let primary = lab.add_ns("primary")?;
        let backup = lab.add_ns("backup")?;
        let lan = lab.add_ns("lan")?;
        lab.add_bridge(&lan, dev::BRIDGE, true)?;
        for (ns, port, mac, ip) in [
            (&client, "client", addr::CLIENT_MAC, addr::CLIENT_V4),
            (&primary, "primary", addr::PRIMARY_MAC, addr::PRIMARY_V4),
            (&backup, "backup", addr::BACKUP_MAC, addr::BACKUP_V4),
        ] {
            lab.add_veth(ns, dev::APP, Some(mac), &lan, port, None)?;
            lab.attach(&lan, port, dev::BRIDGE)?;
            lab.add_addr(ns, dev::APP, &format!("{ip}/24"))?;
        }
        lab.add_addr(&primary, dev::APP, &service_cidr())?;
        Ok(ReplicaLab {
            lab,
            client,
            primary,
            backup,
            lan,
        })
    }

    /// Gives the backup the service address too (after its ARP suppression is in place), and
    /// `arp_announce = 2` on its device, as an operator does (README, "Running replica mode on
    /// your hosts"): its own ARP requests name its host address, never the suppressed service
    /// address. Without it a backup resolves no client's address before the take-over: its
    /// server's packets, withheld at tc egress by the fast path, would wait for a neighbour that
    /// never answers and never reach tc egress.
    pub fn add_backup_service_ip(&mut self) -> io::Result<()> {
        let ns = self.backup.clone();
        crate::lab::sysctls(&ns, &[("net.ipv4.conf.all.arp_announce", "2"), ("net.ipv4.conf.eth0.arp_announce", "2")])?;
        self.lab.add_addr(&ns, dev::APP, &service_cidr())
    }
}

fn service_cidr() -> String {
    format!("{}/32", addr::SERVICE_V4)
}
