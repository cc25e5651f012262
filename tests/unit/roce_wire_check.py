#!/usr/bin/python3
"""The NPU RoCEv2 engine's frames, read by implementations nobody here wrote.

Runs tests/support/roce_pcap (every opcode the engine speaks, every pad count,
the AETH syndromes) and checks the capture it writes:
  - tshark's InfiniBand dissector (RoCEv2 on UDP 4791) decodes every frame:
    infiniband.bth.opcode / destqp / psn / padcnt equal what was built,
    and no frame is malformed or carries an expert error;
  - scapy's RoCE layer (scapy.contrib.roce, IPv4) recomputes each frame's
    ICRC from its own code and gets the bytes the engine wrote.
Usage: roce_wire_check.py ROCE_PCAP_BIN
"""
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    tool = sys.argv[1]
    tshark = shutil.which("tshark")
    if tshark is None:
        sys.exit("tshark not found: run scripts/deps.sh (Debian's tshark)")
    try:
        from scapy.all import Ether, raw, rdpcap  # noqa: E402
        from scapy.contrib.roce import BTH
    except ImportError as e:
        sys.exit(f"scapy not found ({e}): run scripts/deps.sh (Debian's python3-scapy)")

    with tempfile.TemporaryDirectory() as tmp:
        pcap = os.path.join(tmp, "roce.pcap")
        out = subprocess.run([tool, pcap], check=True, capture_output=True, text=True).stdout
        want = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
        assert len(want) > 40, f"only {len(want)} frames"

        # tshark: one line per frame with the BTH fields and any malformation.
        env = dict(os.environ, HOME=tmp)  # no user profile; default dissector prefs
        fields = ["frame.number", "infiniband.bth.opcode", "infiniband.bth.destqp", "infiniband.bth.psn",
                  "infiniband.bth.padcnt", "_ws.malformed", "_ws.expert.severity", "_ws.expert.message"]
        # The payloads are test patterns: keep the dissectors that guess at an
        # upper protocol in an InfiniBand payload (RPC-over-RDMA, SMB Direct,
        # NVMe-oF, ...) from calling them malformed upper-layer messages.
        heur = subprocess.run([tshark, "-G", "heuristic-decodes"], capture_output=True, text=True, env=env).stdout
        off = []
        for line in heur.splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[0] == "infiniband.payload" and parts[1] != "ethertype" \
                    and not parts[1].startswith("infiniband"):
                off += ["--disable-protocol", parts[1]]
        cmd = [tshark, "-n", "-r", pcap, *off, "-T", "fields", "-E", "separator=|", "-E", "occurrence=a"]
        for f in fields:
            cmd += ["-e", f]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            sys.exit(f"tshark failed ({res.returncode}): {res.stderr}")
        rows = [line.split("|") for line in res.stdout.splitlines()]
        assert len(rows) == len(want), f"tshark read {len(rows)} frames, {len(want)} written"
        bad = []
        for row, (n, op, qpn, psn, plen) in zip(rows, want):
            num, t_op, t_qpn, t_psn, t_pad, malformed, severity, message = row
            got = (int(num), int(t_op, 0) if t_op else None, int(t_qpn, 0) if t_qpn else None,
                   int(t_psn, 0) if t_psn else None)
            if got != (n, op, qpn, psn):
                bad.append(f"frame {n}: tshark decoded (frame, opcode, destqp, psn) = {got}, built {(n, op, qpn, psn)}")
            if t_pad and int(t_pad, 0) != (4 - plen % 4) % 4:
                bad.append(f"frame {n}: pad count {t_pad} for a {plen}-byte payload")
            # Expert severities: 0x00800000 = warning, 0x01000000 = error.
            sev = [int(s, 0) for s in severity.split(",") if s]
            if malformed or any(s >= 0x00800000 for s in sev):
                bad.append(f"frame {n} (opcode {op:#04x}): tshark flags it: {malformed} {message}")
        # The dissector must also have seen the InfiniBand layers at all.
        res = subprocess.run([tshark, "-n", "-r", pcap, *off, "-Y", "infiniband.bth", "-T", "fields", "-e", "frame.number"],
                             capture_output=True, text=True, env=env)
        if len(res.stdout.split()) != len(want):
            bad.append(f"tshark matched infiniband.bth in {len(res.stdout.split())} of {len(want)} frames")

        # scapy: parse each frame, drop the ICRC, let scapy's BTH compute it.
        frames = rdpcap(pcap)
        for (n, op, _, _, _), pkt in zip(want, frames):
            orig = raw(pkt)
            if BTH not in pkt:
                bad.append(f"frame {n}: scapy found no BTH")
                continue
            again = Ether(orig)
            again[BTH].icrc = None
            rebuilt = raw(again)
            if rebuilt != orig:
                bad.append(f"frame {n} (opcode {op:#04x}): scapy's ICRC {rebuilt[-4:].hex()} "
                           f"where the engine wrote {orig[-4:].hex()}" if rebuilt[:-4] == orig[:-4]
                           else f"frame {n}: scapy rebuilt different header bytes")
        if bad:
            print("\n".join(bad))
            sys.exit(1)
        print(f"{len(want)} frames: tshark decodes every BTH (no malformed frame, no expert warning); "
              f"scapy's ICRC equals the engine's on all")


if __name__ == "__main__":
    main()
