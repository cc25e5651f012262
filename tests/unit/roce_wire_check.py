#!/usr/bin/python3
"""RoCEv2 frames read by implementations nobody here wrote.

  roce_wire_check.py ROCE_PCAP_BIN
      runs tests/support/roce_pcap (every opcode the NPU engine speaks, every
      pad count, the AETH syndromes) and checks its capture against the list
      the program prints: tshark's InfiniBand dissector decodes each frame with
      the opcode, DestQP, PSN and PadCnt that were built, none is malformed or
      carries an expert warning; scapy's RoCE layer (scapy.contrib.roce, IPv4)
      recomputes each ICRC from its own code and gets the engine's bytes.
  roce_wire_check.py --capture FILE.pcap
      a capture of a live link (tests/qemu/run-roce-interop.sh: the engine and
      Linux's rxe): every UDP 4791 frame decodes in tshark without error, and
      every ICRC, from either side, verifies in scapy. Prints the opcodes each
      address sent.
"""
import collections
import os
import shutil
import subprocess
import sys
import tempfile


def need_tools():
    tshark = shutil.which("tshark")
    if tshark is None:
        sys.exit("tshark not found: run scripts/deps.sh (Debian's tshark)")
    try:
        import scapy.all  # noqa: F401
        import scapy.contrib.roce  # noqa: F401
    except ImportError as e:
        sys.exit(f"scapy not found ({e}): run scripts/deps.sh (Debian's python3-scapy)")
    return tshark


def tshark_fields(tshark, pcap, fields, display_filter=None):
    """One list of field strings per frame (after the display filter)."""
    env = dict(os.environ, HOME=tempfile.gettempdir())  # no user profile: default preferences
    # Keep the dissectors that guess at an upper protocol inside an InfiniBand
    # payload (RPC-over-RDMA, SMB Direct, NVMe-oF, ...) from calling test
    # patterns malformed upper-layer messages.
    heur = subprocess.run([tshark, "-G", "heuristic-decodes"], capture_output=True, text=True, env=env).stdout
    off = []
    for line in heur.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[0] == "infiniband.payload" and parts[1] != "ethertype" \
                and not parts[1].startswith("infiniband"):
            off += ["--disable-protocol", parts[1]]
    cmd = [tshark, "-n", "-r", pcap, *off, "-T", "fields", "-E", "separator=|", "-E", "occurrence=a"]
    if display_filter:
        cmd += ["-Y", display_filter]
    for f in fields:
        cmd += ["-e", f]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"tshark failed ({res.returncode}): {res.stderr}")
    return [line.split("|") for line in res.stdout.splitlines()]


FIELDS = ["frame.number", "ip.src", "infiniband.bth.opcode", "infiniband.bth.destqp", "infiniband.bth.psn",
          "infiniband.bth.padcnt", "_ws.malformed", "_ws.expert.severity", "_ws.expert.message"]


def flagged(row):
    """tshark's complaint about a frame, or None. Severities: 0x00800000 warning, 0x01000000 error."""
    malformed, severity, message = row[6], row[7], row[8]
    sev = [int(s, 0) for s in severity.split(",") if s]
    if malformed or any(s >= 0x00800000 for s in sev):
        return f"{malformed} {message}".strip()
    return None


def icrc_mismatches(pcap, numbers=None):
    """Frames (1-based numbers, all RoCE ones when None) whose ICRC scapy computes differently."""
    from scapy.all import Ether, raw, rdpcap
    from scapy.contrib.roce import BTH
    bad = []
    checked = 0
    for n, pkt in enumerate(rdpcap(pcap), start=1):
        if numbers is not None and n not in numbers:
            continue
        if BTH not in pkt:
            if numbers is not None:
                bad.append(f"frame {n}: scapy found no BTH")
            continue
        orig = raw(pkt)
        again = Ether(orig)
        again[BTH].icrc = None  # recomputed by scapy's post_build
        rebuilt = raw(again)
        checked += 1
        if rebuilt != orig:
            bad.append(f"frame {n}: scapy's ICRC {rebuilt[-4:].hex()} where the frame has {orig[-4:].hex()}"
                       if rebuilt[:-4] == orig[:-4] else f"frame {n}: scapy rebuilt different header bytes")
    return bad, checked


def check_built(tool):
    tshark = need_tools()
    with tempfile.TemporaryDirectory() as tmp:
        pcap = os.path.join(tmp, "roce.pcap")
        out = subprocess.run([tool, pcap], check=True, capture_output=True, text=True).stdout
        want = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
        assert len(want) > 40, f"only {len(want)} frames"
        rows = tshark_fields(tshark, pcap, FIELDS)
        assert len(rows) == len(want), f"tshark read {len(rows)} frames, {len(want)} written"
        bad = []
        for row, (n, op, qpn, psn, plen) in zip(rows, want):
            t_op, t_qpn, t_psn, t_pad = row[2], row[3], row[4], row[5]
            got = (int(row[0]), int(t_op, 0) if t_op else None, int(t_qpn, 0) if t_qpn else None,
                   int(t_psn, 0) if t_psn else None)
            if got != (n, op, qpn, psn):
                bad.append(f"frame {n}: tshark decoded (frame, opcode, destqp, psn) = {got}, built {(n, op, qpn, psn)}")
            if t_pad and int(t_pad, 0) != (4 - plen % 4) % 4:
                bad.append(f"frame {n}: pad count {t_pad} for a {plen}-byte payload")
            why = flagged(row)
            if why:
                bad.append(f"frame {n} (opcode {op:#04x}): tshark flags it: {why}")
        ib = tshark_fields(tshark, pcap, ["frame.number"], "infiniband.bth")
        if len(ib) != len(want):
            bad.append(f"tshark matched infiniband.bth in {len(ib)} of {len(want)} frames")
        icrc_bad, checked = icrc_mismatches(pcap, set(range(1, len(want) + 1)))
        bad += icrc_bad
        if bad:
            print("\n".join(bad))
            sys.exit(1)
        print(f"{len(want)} frames: tshark decodes every BTH (no malformed frame, no expert warning); "
              f"scapy's ICRC equals the engine's on all {checked}")


def check_capture(pcap):
    tshark = need_tools()
    rows = tshark_fields(tshark, pcap, FIELDS, "udp.dstport == 4791")
    bad = []
    sent = collections.defaultdict(collections.Counter)
    numbers = set()
    for row in rows:
        n = int(row[0])
        numbers.add(n)
        if not row[2]:
            bad.append(f"frame {n}: tshark found no BTH on UDP 4791")
            continue
        sent[row[1]][int(row[2], 0)] += 1
        why = flagged(row)
        if why:
            bad.append(f"frame {n} from {row[1]} (opcode {row[2]}): tshark flags it: {why}")
    if not rows:
        bad.append("no RoCE frame in the capture")
    icrc_bad, checked = icrc_mismatches(pcap)
    bad += icrc_bad
    if checked != len(rows):
        bad.append(f"scapy checked {checked} ICRCs, tshark saw {len(rows)} RoCE frames")
    for src, ops in sorted(sent.items()):
        print(f"  {src} sent " + ", ".join(f"{op:#04x} x{c}" for op, c in sorted(ops.items())))
    if bad:
        print("\n".join(bad[:50]))
        sys.exit(1)
    print(f"{len(rows)} RoCE frames: tshark decodes all (no malformed frame, no expert warning); "
          f"scapy's ICRC verifies on all {checked}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--capture":
        check_capture(sys.argv[2])
    elif len(sys.argv) == 2:
        check_built(sys.argv[1])
    else:
        sys.exit(__doc__)
