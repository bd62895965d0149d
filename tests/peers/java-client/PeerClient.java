/*
 * The Java client (org.apache.pulsar:pulsar-client, the shaded artifact applications use)
 * as a command the tests drive as a subprocess.  It subscribes, produces N messages whose
 * payloads carry their index, consumes them at the same time, and prints ONE JSON line:
 * what it sent, which indices the broker acknowledged (per partition, in acknowledgment
 * order) and which it received (per partition, in arrival order), so a test can check
 * that every acknowledged message arrived once and in order per partition.
 *
 * The Go client (../go-client) and the official Python client (../py_client.py) take the
 * same options and print the same line; scripts/setup.sh compiles this file.
 *
 *   java -cp CLASSES:LIB/* PeerClient --url pulsar://127.0.0.1:6650 --topic T --messages 10000 \
 *        [--batching | --no-batching] [--compression LZ4] [--subscription S] [--tls-ca CA.pem]
 *        [--rate MSGS_PER_S] [--timeout S] [--send-timeout S] [--latencies] [--mode roundtrip|consume|txn]
 *        [--txn-size K] [--abort-every A] [--txn-timeout S] [--operation-timeout S]
 *
 * --mode txn (Java only) sends the messages in transactions of K messages, transaction J
 * aborted when A > 0 and J % A == A - 1 and committed otherwise, one after the other; then
 * receives until --idle, and acknowledges what it received in one transaction it commits.
 * The line adds "committed" and "aborted" (transaction numbers), "txn_errors" (number ->
 * the first error of that transaction) and "ack_txn" (committed, or its error).
 */

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.pulsar.client.api.ClientBuilder;
import org.apache.pulsar.client.api.CompressionType;
import org.apache.pulsar.client.api.Consumer;
import org.apache.pulsar.client.api.Message;
import org.apache.pulsar.client.api.MessageId;
import org.apache.pulsar.client.api.MessageIdAdv;
import org.apache.pulsar.client.api.Producer;
import org.apache.pulsar.client.api.PulsarClient;
import org.apache.pulsar.client.api.SubscriptionInitialPosition;
import org.apache.pulsar.client.api.SubscriptionType;
import org.apache.pulsar.client.api.transaction.Transaction;

public final class PeerClient {

    static final class Options {
        String url;
        String topic;
        int messages = 100;
        boolean batching = true;
        String compression = "NONE";
        String subscription = "peers";
        String tlsCa;
        double rate;
        double timeout = 120;
        double idle = 10;
        boolean latencies;
        String mode = "roundtrip";
        int txnSize = 10;
        int abortEvery = 2;
        double txnTimeout = 60;
        double operationTimeout = 30;
        double sendTimeout = 30;

        static Options parse(String[] args) {
            Options o = new Options();
            for (int i = 0; i < args.length; i++) {
                String a = args[i];
                switch (a) {
                    case "--url": o.url = args[++i]; break;
                    case "--topic": o.topic = args[++i]; break;
                    case "--messages": o.messages = Integer.parseInt(args[++i]); break;
                    case "--batching": o.batching = true; break;
                    case "--no-batching": o.batching = false; break;
                    case "--compression": o.compression = args[++i].toUpperCase(); break;
                    case "--subscription": o.subscription = args[++i]; break;
                    case "--tls-ca": o.tlsCa = args[++i]; break;
                    case "--rate": o.rate = Double.parseDouble(args[++i]); break;
                    case "--timeout": o.timeout = Double.parseDouble(args[++i]); break;
                    case "--send-timeout": o.sendTimeout = Double.parseDouble(args[++i]); break;
                    case "--idle": o.idle = Double.parseDouble(args[++i]); break;
                    case "--latencies": o.latencies = true; break;
                    case "--mode": o.mode = args[++i]; break;
                    case "--txn-size": o.txnSize = Integer.parseInt(args[++i]); break;
                    case "--abort-every": o.abortEvery = Integer.parseInt(args[++i]); break;
                    case "--txn-timeout": o.txnTimeout = Double.parseDouble(args[++i]); break;
                    case "--operation-timeout": o.operationTimeout = Double.parseDouble(args[++i]); break;
                    default: throw new IllegalArgumentException("unknown option " + a);
                }
            }
            if (o.url == null || o.topic == null) {
                throw new IllegalArgumentException("--url and --topic are required");
            }
            if (!o.mode.equals("roundtrip") && !o.mode.equals("consume") && !o.mode.equals("txn")) {
                throw new IllegalArgumentException("--mode is roundtrip, consume or txn");
            }
            return o;
        }
    }

    private final Options options;
    private final Map<Integer, List<Integer>> acked = new TreeMap<>();
    private final Map<Integer, List<String>> ackedIds = new TreeMap<>();
    private final Map<Integer, List<Integer>> received = new TreeMap<>();
    private final Map<Integer, List<String>> receivedIds = new TreeMap<>();
    private final double[] latencyMs;
    private final AtomicInteger sendErrors = new AtomicInteger();
    private volatile String firstSendError;
    private final java.util.Set<Integer> seen = new java.util.HashSet<>();
    private final List<Integer> ackedAll = new ArrayList<>();
    private int receivedCount;
    private int sent;
    private double produceSeconds;
    private final List<Integer> committed = new ArrayList<>();
    private final List<Integer> aborted = new ArrayList<>();
    private final Map<Integer, String> txnErrors = new TreeMap<>();
    private String ackTxn;

    private PeerClient(Options options) {
        this.options = options;
        this.latencyMs = new double[options.latencies ? options.messages : 0];
    }

    static byte[] payload(int index) {
        return String.format("%08d|peer-message", index).getBytes(StandardCharsets.UTF_8);
    }

    static int indexOf(byte[] payload) {
        String text = new String(payload, StandardCharsets.UTF_8);
        int bar = text.indexOf('|');
        return Integer.parseInt(bar < 0 ? text : text.substring(0, bar));
    }

    static int partitionOf(MessageId id) {
        return id instanceof MessageIdAdv ? ((MessageIdAdv) id).getPartitionIndex() : -1;
    }

    /** LEDGER:ENTRY:BATCH_INDEX, the same text the Go and Python clients report. */
    static String idText(MessageId id) {
        if (!(id instanceof MessageIdAdv)) {
            return id.toString();
        }
        MessageIdAdv adv = (MessageIdAdv) id;
        return adv.getLedgerId() + ":" + adv.getEntryId() + ":" + adv.getBatchIndex();
    }

    private synchronized void recordAck(int index, MessageId id, long sentAtNanos) {
        acked.computeIfAbsent(partitionOf(id), p -> new ArrayList<>()).add(index);
        ackedIds.computeIfAbsent(partitionOf(id), p -> new ArrayList<>()).add(idText(id));
        ackedAll.add(index);
        if (options.latencies) {
            latencyMs[index] = (System.nanoTime() - sentAtNanos) / 1e6;
        }
    }

    private synchronized void recordReceived(int index, MessageId id) {
        received.computeIfAbsent(partitionOf(id), p -> new ArrayList<>()).add(index);
        receivedIds.computeIfAbsent(partitionOf(id), p -> new ArrayList<>()).add(idText(id));
        seen.add(index);
        receivedCount++;
    }

    private synchronized boolean allAckedReceived(boolean producing) {
        if (producing) {
            return false;
        }
        if (options.mode.equals("consume")) {
            return receivedCount >= options.messages;
        }
        return seen.size() >= ackedAll.size() && seen.containsAll(ackedAll);
    }

    private void produce(PulsarClient client) throws Exception {
        Producer<byte[]> producer = client.newProducer()
                .topic(options.topic)
                .enableBatching(options.batching)
                .compressionType(CompressionType.valueOf(options.compression))
                .blockIfQueueFull(true)
                .maxPendingMessages(1000)
                .sendTimeout((int) (options.sendTimeout * 1000), TimeUnit.MILLISECONDS)
                .create();
        long start = System.nanoTime();
        List<CompletableFuture<MessageId>> pending = new ArrayList<>();
        for (int i = 0; i < options.messages; i++) {
            if (options.rate > 0) {
                long due = start + (long) (i * 1e9 / options.rate);
                long wait = due - System.nanoTime();
                if (wait > 0) {
                    TimeUnit.NANOSECONDS.sleep(wait);
                }
            }
            final int index = i;
            final long sentAt = System.nanoTime();
            pending.add(producer.sendAsync(payload(i)).whenComplete((id, error) -> {
                if (error != null) {
                    sendErrors.incrementAndGet();
                    if (firstSendError == null) {
                        firstSendError = error.toString();
                    }
                } else {
                    recordAck(index, id, sentAt);
                }
            }));
            sent++;
        }
        producer.flush();
        for (CompletableFuture<MessageId> future : pending) {
            try {
                future.get(60, TimeUnit.SECONDS);
            } catch (Exception ignored) {
                // counted in sendErrors by the callback
            }
        }
        produceSeconds = (System.nanoTime() - start) / 1e9;
        producer.close();
    }

    private void consume(Consumer<byte[]> consumer, Thread producerThread, long deadline) throws Exception {
        long lastMessage = System.nanoTime();
        while (System.nanoTime() < deadline) {
            boolean producing = producerThread != null && producerThread.isAlive();
            if (allAckedReceived(producing)) {
                return;
            }
            if (!producing && System.nanoTime() - lastMessage > (long) (options.idle * 1e9)) {
                return;
            }
            Message<byte[]> message = consumer.receive(200, TimeUnit.MILLISECONDS);
            if (message == null) {
                continue;
            }
            lastMessage = System.nanoTime();
            recordReceived(indexOf(message.getValue()), message.getMessageId());
            consumer.acknowledgeAsync(message);
        }
    }

    /** Transaction J's messages, then its commit or abort; J's first error in txnErrors (it is then aborted if it can be). */
    private void produceInTransactions(PulsarClient client) throws Exception {
        Producer<byte[]> producer = client.newProducer()
                .topic(options.topic)
                .enableBatching(options.batching)
                .compressionType(CompressionType.valueOf(options.compression))
                .sendTimeout(0, TimeUnit.SECONDS)  // a transactional producer must not time sends out
                .create();
        long start = System.nanoTime();
        int transactions = (options.messages + options.txnSize - 1) / options.txnSize;
        for (int j = 0; j < transactions; j++) {
            boolean abort = options.abortEvery > 0 && j % options.abortEvery == options.abortEvery - 1;
            Transaction txn = null;
            try {
                txn = client.newTransaction()
                        .withTransactionTimeout((long) (options.txnTimeout * 1000), TimeUnit.MILLISECONDS)
                        .build().get(60, TimeUnit.SECONDS);
                List<CompletableFuture<MessageId>> pending = new ArrayList<>();
                List<Integer> indices = new ArrayList<>();
                for (int i = j * options.txnSize; i < Math.min(options.messages, (j + 1) * options.txnSize); i++) {
                    pending.add(producer.newMessage(txn).value(payload(i)).sendAsync());
                    indices.add(i);
                    sent++;
                }
                producer.flush();
                for (int k = 0; k < pending.size(); k++) {
                    recordAck(indices.get(k), pending.get(k).get(60, TimeUnit.SECONDS), start);
                }
                if (abort) {
                    txn.abort().get(60, TimeUnit.SECONDS);
                    aborted.add(j);
                } else {
                    txn.commit().get(60, TimeUnit.SECONDS);
                    committed.add(j);
                }
            } catch (Exception e) {
                synchronized (this) {
                    txnErrors.put(j, e.toString());
                }
                if (txn != null) {
                    try {
                        txn.abort().get(30, TimeUnit.SECONDS);
                    } catch (Exception ignored) {
                        // the error above is what the report says
                    }
                }
            }
        }
        produceSeconds = (System.nanoTime() - start) / 1e9;
        producer.close();
    }

    /** Receive until --idle, then acknowledge every message received in one transaction and commit it. */
    private void consumeInTransaction(PulsarClient client, Consumer<byte[]> consumer, long deadline) throws Exception {
        List<MessageId> ids = new ArrayList<>();
        long lastMessage = System.nanoTime();
        while (System.nanoTime() < deadline && System.nanoTime() - lastMessage < (long) (options.idle * 1e9)) {
            Message<byte[]> message = consumer.receive(200, TimeUnit.MILLISECONDS);
            if (message == null) {
                continue;
            }
            lastMessage = System.nanoTime();
            recordReceived(indexOf(message.getValue()), message.getMessageId());
            ids.add(message.getMessageId());
        }
        try {
            Transaction txn = client.newTransaction()
                    .withTransactionTimeout((long) (options.txnTimeout * 1000), TimeUnit.MILLISECONDS)
                    .build().get(60, TimeUnit.SECONDS);
            List<CompletableFuture<Void>> acks = new ArrayList<>();
            for (MessageId id : ids) {
                acks.add(consumer.acknowledgeAsync(id, txn));
            }
            for (CompletableFuture<Void> ack : acks) {
                ack.get(60, TimeUnit.SECONDS);
            }
            txn.commit().get(60, TimeUnit.SECONDS);
            ackTxn = "committed";
        } catch (Exception e) {
            ackTxn = e.toString();
        }
    }

    private String run() throws Exception {
        long started = System.nanoTime();
        long deadline = started + (long) (options.timeout * 1e9);
        ClientBuilder builder = PulsarClient.builder()
                .serviceUrl(options.url)
                .operationTimeout((int) (options.operationTimeout * 1000), TimeUnit.MILLISECONDS);
        if (options.mode.equals("txn")) {
            builder.enableTransaction(true);
        }
        if (options.tlsCa != null) {
            builder.tlsTrustCertsFilePath(options.tlsCa).enableTlsHostnameVerification(true);
        }
        String error = null;
        // The client is not closed: its producer and consumer are (the broker sees them go), and
        // main() exits right after the report, which spares the event loops' 2 s graceful shutdown.
        PulsarClient client = null;
        try {
            client = builder.build();
            Consumer<byte[]> consumer = client.newConsumer()
                    .topic(options.topic)
                    .subscriptionName(options.subscription)
                    .subscriptionType(SubscriptionType.Exclusive)
                    .subscriptionInitialPosition(SubscriptionInitialPosition.Earliest)
                    .subscribe();
            Thread producerThread = null;
            final Exception[] produceError = new Exception[1];
            if (options.mode.equals("txn")) {
                produceInTransactions(client);
                consumeInTransaction(client, consumer, deadline);
                consumer.close();
                return report(null, (System.nanoTime() - started) / 1e9);
            }
            if (options.mode.equals("roundtrip")) {
                final PulsarClient producing = client;
                producerThread = new Thread(() -> {
                    try {
                        produce(producing);
                    } catch (Exception e) {
                        produceError[0] = e;
                    }
                }, "producer");
                producerThread.start();
            }
            consume(consumer, producerThread, deadline);
            if (producerThread != null) {
                producerThread.join(Math.max(1, (deadline - System.nanoTime()) / 1_000_000));
            }
            if (produceError[0] != null) {
                error = "producer: " + produceError[0];
            }
            consumer.close();
        } catch (Exception e) {
            error = e.toString();
        }
        return report(error, (System.nanoTime() - started) / 1e9);
    }

    private synchronized String report(String error, double elapsed) {
        StringBuilder json = new StringBuilder("{\"client\":\"java\"");
        json.append(",\"topic\":").append(quote(options.topic));
        json.append(",\"mode\":").append(quote(options.mode));
        json.append(",\"sent\":").append(sent);
        json.append(",\"send_errors\":").append(sendErrors.get());
        json.append(",\"first_send_error\":").append(quote(firstSendError));
        json.append(",\"acked\":");
        appendPartitions(json, acked);
        json.append(",\"acked_ids\":");
        appendPartitions(json, ackedIds);
        json.append(",\"received\":");
        appendPartitions(json, received);
        json.append(",\"received_ids\":");
        appendPartitions(json, receivedIds);
        if (options.latencies) {
            json.append(",\"latency_ms\":[");
            for (int i = 0; i < latencyMs.length; i++) {
                json.append(i == 0 ? "" : ",").append(String.format("%.3f", latencyMs[i]));
            }
            json.append(']');
        }
        if (options.mode.equals("txn")) {
            json.append(",\"committed\":").append(committed);
            json.append(",\"aborted\":").append(aborted);
            json.append(",\"txn_errors\":{");
            boolean first = true;
            for (Map.Entry<Integer, String> entry : txnErrors.entrySet()) {
                json.append(first ? "" : ",").append('"').append(entry.getKey()).append("\":")
                        .append(quote(entry.getValue()));
                first = false;
            }
            json.append("},\"ack_txn\":").append(quote(ackTxn));
        }
        json.append(",\"produce_seconds\":").append(String.format("%.3f", produceSeconds));
        json.append(",\"elapsed_seconds\":").append(String.format("%.3f", elapsed));
        json.append(",\"error\":").append(quote(error)).append('}');
        return json.toString();
    }

    private static <T> void appendPartitions(StringBuilder json, Map<Integer, List<T>> partitions) {
        json.append('{');
        boolean first = true;
        for (Map.Entry<Integer, List<T>> entry : partitions.entrySet()) {
            json.append(first ? "" : ",").append('"').append(entry.getKey()).append("\":[");
            List<T> values = entry.getValue();
            for (int i = 0; i < values.size(); i++) {
                T value = values.get(i);
                json.append(i == 0 ? "" : ",").append(value instanceof String ? quote((String) value) : value);
            }
            json.append(']');
            first = false;
        }
        json.append('}');
    }

    private static String quote(String text) {
        if (text == null) {
            return "null";
        }
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }

    public static void main(String[] args) {
        Options options;
        try {
            options = Options.parse(args);
        } catch (RuntimeException e) {
            System.err.println("PeerClient: " + e.getMessage());
            System.exit(2);
            return;
        }
        String line;
        try {
            line = new PeerClient(options).run();
        } catch (Exception e) {
            line = "{\"client\":\"java\",\"error\":" + quote(e.toString()) + "}";
        }
        System.out.println(line);
        System.out.flush();
        // the client's own threads must not keep the process alive
        System.exit(0);
    }
}
