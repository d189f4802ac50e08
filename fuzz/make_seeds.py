#!/usr/bin/python3
"""Writes the seed corpora of swirl's fuzz targets: fuzz/corpus/<target>/<name>.

    fuzz/make_seeds.py            rewrites every seed (deterministic: same bytes every time)

Each seed is a well-formed input of its target's format (the layouts are in each target's
header comment and mirrored here), one per kind of message the parser takes, plus a few near
misses, so that fuzzing starts inside the protocol rather than at its front door. They are
small (a few KiB per target in all); corpus files that fuzzing finds are not committed (see
./swirl fuzz), crash reproducers go to fuzz/regressions/<target>/ by hand.
"""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- rpc_wire_fuzzer: MessageHeader (32 bytes), max_payload, max_credits, payload -------------

REQUEST, RESPONSE, ONE_WAY, CANCEL, CREDIT, PING, PONG, BULK_ACK, WINDOW_GRANT = range(1, 10)
FLAG_BULK, FLAG_REPLY_CHUNK = 1, 2
AUX_BULK_IS_MESSAGE = 1


def header(type_, payload_len, flags=0, method_id=0, request_id=1, status=0, credits=1, aux=0,
           version=2):
    return struct.pack("<BBHIQIIII", version, type_, flags, method_id, request_id, status,
                       payload_len, credits, aux)


def wire_seed(name, type_, payload, limits=(4064, 32), **kw):
    write("rpc_wire_fuzzer", name,
          header(type_, len(payload), **kw) + struct.pack("<II", *limits) + payload)


def descriptor(addr=0x7f0000001000, length=65536, rkey=0x1234):
    return struct.pack("<QII", addr, length, rkey)


METHOD = 0x5a17e3c1
wire_seed("request", REQUEST, b"\x0a\x05hello", method_id=METHOD)
wire_seed("one_way", ONE_WAY, b"\x08\x01", method_id=METHOD)
wire_seed("response_ok", RESPONSE, b"\x0a\x05hello")
wire_seed("response_error", RESPONSE, b"", status=5)
wire_seed("credit", CREDIT, b"", credits=16)
wire_seed("ping", PING, b"", credits=0)
wire_seed("cancel", CANCEL, b"")
wire_seed("bulk_request", REQUEST, descriptor() + b"\x08\x01", method_id=METHOD,
          flags=FLAG_BULK)
wire_seed("bulk_request_as_message", REQUEST, descriptor(), method_id=METHOD, flags=FLAG_BULK,
          aux=AUX_BULK_IS_MESSAGE)
wire_seed("mirror_request", REQUEST, descriptor() + descriptor(rkey=0x5678) + b"\x08\x01",
          method_id=METHOD, flags=FLAG_BULK | FLAG_REPLY_CHUNK)
wire_seed("bulk_response", RESPONSE, descriptor(), flags=FLAG_BULK, aux=AUX_BULK_IS_MESSAGE)
wire_seed("window_grant", WINDOW_GRANT, descriptor() + descriptor(rkey=0x99), aux=2)
wire_seed("bulk_ack", BULK_ACK, b"", aux=0x1234)
wire_seed("near_miss_short_descriptor", REQUEST, b"\x00" * 8, method_id=METHOD, flags=FLAG_BULK)
wire_seed("near_miss_version", REQUEST, b"", method_id=METHOD, version=1)

# ---- handshake_fuzzer: one byte (the server's side), then a ConnectRequest ---------------------


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(number, value):
    return varint(number << 3) + varint(value)


def field_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


SHM_GID = bytes([0xFE, 0x80] + [0] * 6 + [0x02, 0x11, 0x22, 0xFF, 0xFE, 0x33, 0x44, 0x55])
TCP_GID = bytes([0] * 8 + [0x12, 0xB7, 0xFF, 0xFF, 127, 0, 0, 1])


def connect_request(version=3, name=b"client", gid=SHM_GID, qp_num=0x1234, psn=100, mtu=3,
                    kind=b"soft", remote_inv=True, credits=32, buffer_size=4128,
                    max_message=4096, eager=2048, window_credits=8, require=False, bulk_mode=0,
                    max_bulk=16 << 20, max_inline=256):
    address = (field_bytes(1, gid) + field_varint(3, qp_num) + field_varint(4, psn) +
               field_varint(5, mtu))
    caps = (field_bytes(1, b"soft0") + field_bytes(2, kind) + field_varint(3, int(remote_inv)) +
            field_varint(4, 1) + field_varint(5, max_inline) + field_varint(6, credits) +
            field_varint(7, buffer_size) + field_varint(8, max_message) +
            field_varint(9, eager) + field_varint(10, window_credits) +
            field_varint(11, int(require)) + field_varint(12, bulk_mode) +
            field_varint(13, max_bulk))
    return (field_varint(1, version) + field_bytes(2, name) + field_bytes(3, address) +
            field_bytes(4, caps))


def handshake_seed(seed_name, server_choice, **kw):
    write("handshake_fuzzer", seed_name, bytes([server_choice]) + connect_request(**kw))


handshake_seed("soft_shm", 0)
handshake_seed("soft_tcp", 4, gid=TCP_GID)
handshake_seed("rdma_core", 1, kind=b"rdma-core", gid=bytes(16))
handshake_seed("local_fallback", 2, remote_inv=False)
handshake_seed("require_remote", 8, require=True)
handshake_seed("mirror", 0, bulk_mode=1)
handshake_seed("static_rkey_allowed", 64, bulk_mode=2)
handshake_seed("small_server", 128, credits=4, buffer_size=128, max_message=96, eager=64)
handshake_seed("huge_values", 0, credits=4096, buffer_size=0xFFFFFFFF, max_message=0xFFFFFFDF,
               eager=0xFFFFFFFF, window_credits=0xFFFFFFFF, max_bulk=(1 << 64) - 1)
handshake_seed("near_miss_version", 0, version=2)
handshake_seed("near_miss_credits", 0, credits=3)
handshake_seed("near_miss_fabric", 0, gid=TCP_GID)
handshake_seed("long_name", 0, name=b"\x1b[31m\n" * 50)

# ---- soft_responder_fuzzer: 48-byte FrameRecords -------------------------------------------------

FIX_MSN, RAW_ACK, FIX_RKEY, USE_WINDOW, FIX_ADDRESS, FIX_INVALIDATE, AWAIT, SHORT = (
    1 << i for i in range(8))
OP_PAD, OP_SEND, OP_WRITE, OP_READ, OP_CAS, OP_FAA = 1, 2, 3, 4, 5, 6
FIRST, LAST, WITH_IMM, WITH_INV, SOLICITED = 1, 2, 4, 8, 16
WINDOW = 32 * 1024  # the window's offset in B's region (16 KiB)
TARGET = 96 * 1024  # clear of the receives


def frame(fix, op, flags, length, total=None, msn=0, ack=0, imm=0, addr=0, rkey=0,
          ext_length=None, compare_add=0, fill=0xAB):
    total = length if total is None else total
    ext_length = total if ext_length is None else ext_length
    return struct.pack("<BBBBIIIIIQIIQ", fix, op, flags, fill, length, total, msn, ack, imm, addr,
                       rkey, ext_length, compare_add)


assert len(frame(0, 0, 0, 0)) == 48
WRITE_FIX = FIX_MSN | FIX_RKEY | FIX_ADDRESS
seeds = {
    "send": frame(FIX_MSN | AWAIT, OP_SEND, FIRST | LAST, 16),
    "send_with_imm": frame(FIX_MSN, OP_SEND, FIRST | LAST | WITH_IMM | SOLICITED, 8, imm=7),
    "send_with_inv": frame(FIX_MSN | FIX_INVALIDATE | AWAIT, OP_SEND, FIRST | LAST | WITH_INV, 0),
    "send_two_chunks": frame(FIX_MSN, OP_SEND, FIRST, 32768, 40000) +
                       frame(FIX_MSN, OP_SEND, LAST, 7232, 40000),
    "write": frame(WRITE_FIX | AWAIT, OP_WRITE, FIRST | LAST, 64, addr=TARGET),
    "write_window": frame(WRITE_FIX | USE_WINDOW, OP_WRITE, FIRST | LAST, 64, addr=WINDOW + 512),
    "write_with_imm": frame(WRITE_FIX, OP_WRITE, FIRST | LAST | WITH_IMM, 128, addr=TARGET),
    "write_two_chunks": frame(WRITE_FIX, OP_WRITE, FIRST, 32768, 32896, addr=0) +
                        frame(WRITE_FIX, OP_WRITE, LAST, 128, 32896, addr=32768),
    "read": frame(WRITE_FIX | AWAIT, OP_READ, 0, 0, 256, addr=1024, ext_length=256),
    "read_window": frame(WRITE_FIX | USE_WINDOW | AWAIT, OP_READ, 0, 0, 4096, addr=WINDOW,
                         ext_length=4096),
    "fetch_add": frame(WRITE_FIX | AWAIT, OP_FAA, 0, 0, 8, addr=TARGET, compare_add=1),
    "compare_swap": frame(WRITE_FIX | AWAIT, OP_CAS, 0, 0, 8, addr=TARGET + 8),
    "write_then_send": frame(WRITE_FIX, OP_WRITE, FIRST | LAST, 256, addr=TARGET) +
                       frame(FIX_MSN | AWAIT, OP_SEND, FIRST | LAST, 32),
    "pad_then_send": frame(FIX_MSN, OP_PAD, 0, 0) + frame(FIX_MSN, OP_SEND, FIRST | LAST, 16),
    "near_miss_guard": frame(WRITE_FIX, OP_WRITE, FIRST | LAST, 64, addr=(1 << 32) - 32),
    "near_miss_flags": frame(FIX_MSN, OP_SEND, FIRST | LAST | 0x40, 16),
    "near_miss_msn": frame(0, OP_SEND, FIRST | LAST, 16, msn=12345),
}
for name, data in seeds.items():
    write("soft_responder_fuzzer", name, data)

# ---- soft_requester_fuzzer: count, 8-byte Requests, 32-byte Answers ----------------------------

READ, WRITE, SEND, FAA, CAS = range(5)
RR, AR, NAK, RAW = range(4)
PUBLISH, MSN_OF, ACK_UP_TO, RAW_ACK_, SHORT_, POLL = (1 << i for i in range(2, 8))
WORD_REQ_CONSUMED, WORD_RESP_CONSUMED, WORD_ACKED, WORD_STATE = range(4)
REM_INV_REQ_ERR, REM_ACCESS_ERR, REM_OP_ERR, RETRY_EXC_ERR, RNR_RETRY_EXC_ERR = 9, 10, 11, 12, 13


def requests(*reqs):
    out = bytes([len(reqs) - 1])
    for opcode, offset_units, length in reqs:
        out += struct.pack("<BBHI", opcode, 0, offset_units, length)
    return out


def answer(how, op=0, flags=0, request=0, ack_request=0, length=0, total=0, msn=0, ack=0,
           status=0, high=0, fill=0xAB):
    return struct.pack("<BBBBBBHIIIIII", how, op, flags, request, ack_request, fill, 0, length,
                       total, msn, ack, status, high)


assert len(answer(0)) == 32
HONEST = MSN_OF | ACK_UP_TO
seeds = {
    "read": requests((READ, 0, 64)) + answer(RR | HONEST, length=64),
    "read_two_chunks": requests((READ, 0, 64)) + answer(RR | HONEST, length=32) +
                       answer(RR | HONEST | POLL, length=32, total=32),
    "atomic": requests((FAA, 64, 8)) + answer(AR | HONEST),
    "read_atomic_send": requests((READ, 0, 64), (FAA, 64, 8), (SEND, 128, 16)) +
                        answer(RR | HONEST, length=32) + answer(RR | HONEST, length=32, total=32) +
                        answer(AR | HONEST, request=1, ack_request=1) +
                        answer(PUBLISH | MSN_OF, op=WORD_ACKED, ack_request=2),
    "send_acked": requests((SEND, 0, 16)) + answer(PUBLISH | MSN_OF, op=WORD_ACKED),
    "write_acked_consumed": requests((WRITE, 0, 4096)) +
                            answer(PUBLISH | MSN_OF, op=WORD_REQ_CONSUMED) +
                            answer(PUBLISH | MSN_OF, op=WORD_ACKED),
    "nak": requests((WRITE, 0, 64), (SEND, 2, 8)) + answer(NAK | MSN_OF, status=REM_ACCESS_ERR),
    "peer_error": requests((SEND, 0, 16)) + answer(PUBLISH, op=WORD_STATE, msn=1),
    "big_read": requests((READ, 0, 65535)) + answer(RR | HONEST, length=32768) +
                answer(RR | HONEST | POLL, length=32767, total=32768),
    "near_miss_offset": requests((READ, 0, 64)) + answer(RR | HONEST, length=64, total=8),
    "near_miss_ack": requests((SEND, 0, 16)) + answer(PUBLISH, op=WORD_ACKED, msn=0xFFFFFF),
    "near_miss_consumed": requests((WRITE, 0, 64)) +
                          answer(PUBLISH, op=WORD_REQ_CONSUMED, msn=1 << 20),
}
for name, data in seeds.items():
    write("soft_requester_fuzzer", name, data)

# ---- tcp_link_fuzzer: how, a 112-byte hello, then the stream of records ------------------------

RIGHT_IDENTITY, RIGHT_GEOMETRY, RIGHT_CONTROL, VICTIM_SENDS = 1, 2, 4, 8
ALL_RIGHT = RIGHT_IDENTITY | RIGHT_GEOMETRY | RIGHT_CONTROL
PEER_PSN, VICTIM_PSN = 500, 100
STAMP_VALID = 1 << 63
RINGS, MIN_RING = 4096, 16 * 1024


def record(kind, ring, length, position):
    return struct.pack("<BBHIQ", kind, ring, 0, length, position)


def send_frame(position, msn, ack, text):
    h = struct.pack("<QBBBBIIIII", STAMP_VALID | position, OP_SEND, FIRST | LAST, 7, 0,
                    len(text), msn, ack, 0, len(text))
    body = h + text
    body += b"\0" * (128 - len(body))
    return record(1, 0, 128, position) + body


def control(req_consumed, resp_consumed, acked, state):
    return record(2, 0, 32, 0) + struct.pack("<QQQQ", req_consumed, resp_consumed, acked, state)


def hello(magic=0x3150435457535731, version=3, segment=RINGS + 2 * MIN_RING, req_off=RINGS,
          req_size=MIN_RING, resp_off=RINGS + MIN_RING, resp_size=MIN_RING,
          ctl=(0, 0, VICTIM_PSN, 0)):
    return (struct.pack("<QIIII", magic, version, 0, 0, 0) + bytes(16) +
            struct.pack("<QQQQQ", segment, req_off, req_size, resp_off, resp_size) +
            struct.pack("<QQQQ", *ctl))


assert len(hello()) == 112
seeds = {
    "send": bytes([ALL_RIGHT]) + hello() + send_frame(0, PEER_PSN, VICTIM_PSN, b"from elsewhere"),
    "send_and_ack": bytes([ALL_RIGHT | VICTIM_SENDS]) + hello() +
                    send_frame(0, PEER_PSN, VICTIM_PSN + 1, b"hi") +
                    control(0, 0, VICTIM_PSN + 1, 0),
    "two_sends": bytes([ALL_RIGHT]) + hello() + send_frame(0, PEER_PSN, VICTIM_PSN, b"one") +
                 send_frame(128, PEER_PSN + 1, VICTIM_PSN, b"two"),
    "hello_only": bytes([ALL_RIGHT]) + hello(),
    "peer_error": bytes([ALL_RIGHT | VICTIM_SENDS]) + hello() + control(0, 0, VICTIM_PSN, 1),
    "geometry_from_input": bytes([RIGHT_IDENTITY]) + hello(req_size=MIN_RING * 2,
                                                           resp_off=RINGS + 2 * MIN_RING,
                                                           segment=RINGS + 3 * MIN_RING),
    "garbage_hello": bytes([0]) + b"\x5a" * 112,
    "near_miss_position": bytes([ALL_RIGHT]) + hello() +
                          send_frame(128, PEER_PSN, VICTIM_PSN, b"late"),
    "near_miss_control_length": bytes([ALL_RIGHT]) + hello() + record(2, 0, 24, 0) + bytes(24),
    "near_miss_ring": bytes([ALL_RIGHT]) + hello() + record(1, 2, 128, 0) + bytes(128),
}
for name, data in seeds.items():
    write("tcp_link_fuzzer", name, data)
