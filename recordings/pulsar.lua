-- A Wireshark / tshark dissector for the Apache Pulsar binary protocol (pulsar-tap).
--
-- Wireshark ships no Pulsar dissector, and decodes Pulsar's default port 6650 as SMPP
-- (every frame then shows as "Malformed SMPP").  Load this file to read pcaps made by
-- `pulsar-tap export --pcap` (or any capture of Pulsar traffic in plain TCP):
--
--   tshark -X lua_script:recordings/pulsar.lua -r out.pcapng                     (port 6650)
--   tshark -X lua_script:recordings/pulsar.lua -d tcp.port==41650,pulsar -r out.pcapng
--
-- or copy it to Wireshark's personal Lua plugins folder (Help > About > Folders) and use
-- "Decode As... > TCP port > PULSAR" for brokers on other ports.
--
-- It decodes the framing SPEC.md describes: [TOTAL_SIZE u32][CMD_SIZE u32][BaseCommand],
-- then for SEND / MESSAGE an optional [0x0e02][u32 size][BrokerEntryMetadata] and
-- [0x0e01][CRC32C u32][METADATA_SIZE u32][MessageMetadata][payload].  Of the command it
-- reads the type (BaseCommand field 1); frames split over TCP segments are reassembled.
-- A frame whose sizes or magic are wrong is flagged as malformed.

local pulsar = Proto("pulsar", "Apache Pulsar binary protocol")

-- BaseCommand.Type (proto/PulsarApi.proto); tests/recording checks this table is complete.
local COMMANDS = {
    [2] = "CONNECT", [3] = "CONNECTED", [4] = "SUBSCRIBE", [5] = "PRODUCER", [6] = "SEND",
    [7] = "SEND_RECEIPT", [8] = "SEND_ERROR", [9] = "MESSAGE", [10] = "ACK", [11] = "FLOW",
    [12] = "UNSUBSCRIBE", [13] = "SUCCESS", [14] = "ERROR", [15] = "CLOSE_PRODUCER",
    [16] = "CLOSE_CONSUMER", [17] = "PRODUCER_SUCCESS", [18] = "PING", [19] = "PONG",
    [20] = "REDELIVER_UNACKNOWLEDGED_MESSAGES", [21] = "PARTITIONED_METADATA",
    [22] = "PARTITIONED_METADATA_RESPONSE", [23] = "LOOKUP", [24] = "LOOKUP_RESPONSE",
    [25] = "CONSUMER_STATS", [26] = "CONSUMER_STATS_RESPONSE", [27] = "REACHED_END_OF_TOPIC",
    [28] = "SEEK", [29] = "GET_LAST_MESSAGE_ID", [30] = "GET_LAST_MESSAGE_ID_RESPONSE",
    [31] = "ACTIVE_CONSUMER_CHANGE", [32] = "GET_TOPICS_OF_NAMESPACE",
    [33] = "GET_TOPICS_OF_NAMESPACE_RESPONSE", [34] = "GET_SCHEMA", [35] = "GET_SCHEMA_RESPONSE",
    [36] = "AUTH_CHALLENGE", [37] = "AUTH_RESPONSE", [38] = "ACK_RESPONSE", [39] = "GET_OR_CREATE_SCHEMA",
    [40] = "GET_OR_CREATE_SCHEMA_RESPONSE", [50] = "NEW_TXN", [51] = "NEW_TXN_RESPONSE",
    [52] = "ADD_PARTITION_TO_TXN", [53] = "ADD_PARTITION_TO_TXN_RESPONSE", [54] = "ADD_SUBSCRIPTION_TO_TXN",
    [55] = "ADD_SUBSCRIPTION_TO_TXN_RESPONSE", [56] = "END_TXN", [57] = "END_TXN_RESPONSE",
    [58] = "END_TXN_ON_PARTITION", [59] = "END_TXN_ON_PARTITION_RESPONSE", [60] = "END_TXN_ON_SUBSCRIPTION",
    [61] = "END_TXN_ON_SUBSCRIPTION_RESPONSE", [62] = "TC_CLIENT_CONNECT_REQUEST",
    [63] = "TC_CLIENT_CONNECT_RESPONSE", [64] = "WATCH_TOPIC_LIST", [65] = "WATCH_TOPIC_LIST_SUCCESS",
    [66] = "WATCH_TOPIC_UPDATE", [67] = "WATCH_TOPIC_LIST_CLOSE", [68] = "TOPIC_MIGRATED",
    [70] = "SCALABLE_TOPIC_LOOKUP", [71] = "SCALABLE_TOPIC_UPDATE", [72] = "SCALABLE_TOPIC_CLOSE",
    [73] = "SCALABLE_TOPIC_SUBSCRIBE", [74] = "SCALABLE_TOPIC_SUBSCRIBE_RESPONSE",
    [75] = "SCALABLE_TOPIC_ASSIGNMENT_UPDATE", [76] = "WATCH_SCALABLE_TOPICS",
    [77] = "WATCH_SCALABLE_TOPICS_UPDATE", [78] = "WATCH_SCALABLE_TOPICS_CLOSE", [79] = "WATCH_TC_ASSIGNMENTS",
    [80] = "WATCH_TC_ASSIGNMENTS_UPDATE", [81] = "WATCH_TC_ASSIGNMENTS_CLOSE",
}

local MAGIC_CHECKSUM = 0x0e01
local MAGIC_BROKER_ENTRY_METADATA = 0x0e02
--- a frame may not claim more than this (Pulsar's 5 MiB default, raised by max_message_size)
local MAX_FRAME = 128 * 1024 * 1024

local f = pulsar.fields
f.total_size = ProtoField.uint32("pulsar.total_size", "Total size", base.DEC)
f.command_size = ProtoField.uint32("pulsar.command_size", "Command size", base.DEC)
f.command = ProtoField.uint32("pulsar.command", "Command", base.DEC, COMMANDS)
f.command_bytes = ProtoField.bytes("pulsar.command_bytes", "BaseCommand")
f.broker_entry_metadata = ProtoField.bytes("pulsar.broker_entry_metadata", "BrokerEntryMetadata")
f.magic = ProtoField.uint16("pulsar.magic", "Magic", base.HEX)
f.checksum = ProtoField.uint32("pulsar.checksum", "CRC32C", base.HEX)
f.metadata_size = ProtoField.uint32("pulsar.metadata_size", "Metadata size", base.DEC)
f.metadata = ProtoField.bytes("pulsar.metadata", "MessageMetadata")
f.payload = ProtoField.bytes("pulsar.payload", "Payload")

local malformed = ProtoExpert.new("pulsar.malformed", "Malformed Pulsar frame", expert.group.MALFORMED,
                                  expert.severity.ERROR)
pulsar.experts = { malformed }

--- the varint at offset (a protobuf tag or value): value, length; nil when it runs past the end
local function varint(tvb, offset, limit)
    local value, shift = 0, 0
    for i = 0, 9 do
        if offset + i >= limit then return nil end
        local byte = tvb(offset + i, 1):uint()
        value = value + (byte % 128) * (2 ^ shift)
        if byte < 128 then return value, i + 1 end
        shift = shift + 7
    end
    return nil
end

--- BaseCommand.type: field 1 (tag 0x08) is written first by every Pulsar implementation
local function command_type(tvb, offset, size)
    if size < 2 or tvb(offset, 1):uint() ~= 0x08 then return nil end
    local value = varint(tvb, offset + 1, offset + size)
    return value
end

--- a frame the dissector cannot decode: an expert error, and the summary line says so
local function flag(item, pinfo, reason)
    item:add_proto_expert_info(malformed, reason)
    pinfo.cols.info:append(" [Malformed Pulsar frame: " .. reason .. "]")
end

local function frame_length(tvb, pinfo, offset)
    return tvb(offset, 4):uint() + 4
end

local function dissect_frame(tvb, pinfo, tree)
    local length = tvb:len()
    local total = tvb(0, 4):uint()
    local item = tree:add(pulsar, tvb(), "Pulsar")
    item:add(f.total_size, tvb(0, 4))
    if total < 4 or total > MAX_FRAME then
        flag(item, pinfo, "total size out of range")
        return length
    end
    local cmd_size = tvb(4, 4):uint()
    item:add(f.command_size, tvb(4, 4))
    if cmd_size == 0 or cmd_size > total - 4 then
        flag(item, pinfo, "command size larger than the frame")
        return length
    end
    local kind = command_type(tvb, 8, cmd_size)
    local name = kind and COMMANDS[kind] or "unknown command"
    if kind then item:add(f.command, tvb(9, 1), kind) end
    item:add(f.command_bytes, tvb(8, cmd_size))
    item:append_text(", " .. name)
    if not kind or not COMMANDS[kind] then
        flag(item, pinfo, "unknown command type")
    end
    local info = tostring(pinfo.cols.info)
    if info:sub(1, 7) ~= "Pulsar:" then
        pinfo.cols.info = "Pulsar: " .. name
    else
        pinfo.cols.info:append(", " .. name)
    end
    local pos = 8 + cmd_size
    local stop = 4 + total
    if pos < stop then
        if pos + 2 <= stop and tvb(pos, 2):uint() == MAGIC_BROKER_ENTRY_METADATA then
            local size = pos + 6 <= stop and tvb(pos + 2, 4):uint() or stop
            if pos + 6 + size > stop then
                flag(item, pinfo, "broker entry metadata runs past the frame")
                return length
            end
            item:add(f.magic, tvb(pos, 2))
            item:add(f.broker_entry_metadata, tvb(pos + 6, size))
            pos = pos + 6 + size
        end
        if pos + 10 > stop or tvb(pos, 2):uint() ~= MAGIC_CHECKSUM then
            flag(item, pinfo, "payload section without the checksum magic")
            return length
        end
        item:add(f.magic, tvb(pos, 2))
        item:add(f.checksum, tvb(pos + 2, 4))
        local meta_size = tvb(pos + 6, 4):uint()
        item:add(f.metadata_size, tvb(pos + 6, 4))
        if pos + 10 + meta_size > stop then
            flag(item, pinfo, "message metadata runs past the frame")
            return length
        end
        item:add(f.metadata, tvb(pos + 10, meta_size))
        if pos + 10 + meta_size < stop then
            item:add(f.payload, tvb(pos + 10 + meta_size, stop - pos - 10 - meta_size))
        end
    end
    return length
end

function pulsar.dissector(tvb, pinfo, tree)
    pinfo.cols.protocol = "PULSAR"
    dissect_tcp_pdus(tvb, tree, 4, frame_length, dissect_frame)
    return tvb:len()
end

DissectorTable.get("tcp.port"):add(6650, pulsar)
