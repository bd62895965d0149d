// The Go client (github.com/apache/pulsar-client-go) as a command the tests drive as a
// subprocess: the same options and the same one-line JSON report as ../java-client's
// PeerClient and ../py_client.py.  It subscribes, produces N messages whose payloads carry
// their index, consumes them at the same time, and reports which indices the broker
// acknowledged and which arrived, per partition and in order.  scripts/setup.sh builds it.
//
//	go-client --url pulsar://127.0.0.1:6650 --topic T --messages 10000 [--batching | --no-batching]
//	          [--compression LZ4] [--subscription S] [--tls-ca CA.pem] [--rate R] [--timeout S] [--send-timeout S]
//	          [--latencies] [--mode roundtrip|consume]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/apache/pulsar-client-go/pulsar"
	"github.com/apache/pulsar-client-go/pulsar/log"
)

type options struct {
	url          string
	topic        string
	messages     int
	batching     bool
	compression  string
	subscription string
	tlsCA        string
	rate         float64
	timeout      time.Duration
	sendTimeout  time.Duration
	idle         time.Duration
	latencies    bool
	mode         string
}

type report struct {
	Client         string              `json:"client"`
	Topic          string              `json:"topic"`
	Mode           string              `json:"mode"`
	Sent           int                 `json:"sent"`
	SendErrors     int                 `json:"send_errors"`
	FirstSendError *string             `json:"first_send_error"`
	Acked          map[string][]int    `json:"acked"`
	AckedIDs       map[string][]string `json:"acked_ids"`
	Received       map[string][]int    `json:"received"`
	ReceivedIDs    map[string][]string `json:"received_ids"`
	LatencyMs      []float64           `json:"latency_ms,omitempty"`
	ProduceSeconds float64             `json:"produce_seconds"`
	ElapsedSeconds float64             `json:"elapsed_seconds"`
	Error          *string             `json:"error"`
}

type tally struct {
	mu       sync.Mutex
	acked    map[int32][]int
	ackedIDs map[int32][]string
	ackedAll []int
	received map[int32][]int
	recvIDs  map[int32][]string
	seen     map[int]bool
	latency  []float64
	errors   int
	firstErr string
}

func payload(index int) []byte {
	return []byte(fmt.Sprintf("%08d|peer-message", index))
}

func indexOf(data []byte) (int, error) {
	text := string(data)
	if bar := strings.IndexByte(text, '|'); bar >= 0 {
		text = text[:bar]
	}
	return strconv.Atoi(text)
}

// idText is LEDGER:ENTRY:BATCH_INDEX, the same text the Java and Python clients report.
func idText(id pulsar.MessageID) string {
	return fmt.Sprintf("%d:%d:%d", id.LedgerID(), id.EntryID(), id.BatchIdx())
}

func compressionOf(name string) (pulsar.CompressionType, error) {
	switch strings.ToUpper(name) {
	case "NONE":
		return pulsar.NoCompression, nil
	case "LZ4":
		return pulsar.LZ4, nil
	case "ZLIB":
		return pulsar.ZLib, nil
	case "ZSTD":
		return pulsar.ZSTD, nil
	}
	return 0, fmt.Errorf("unsupported compression %q", name)
}

func (t *tally) allAckedReceived(o *options) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if o.mode == "consume" {
		return len(t.seen) >= o.messages
	}
	if len(t.seen) < len(t.ackedAll) {
		return false
	}
	for _, index := range t.ackedAll {
		if !t.seen[index] {
			return false
		}
	}
	return true
}

func produce(ctx context.Context, client pulsar.Client, o *options, t *tally, sent *int) error {
	compression, err := compressionOf(o.compression)
	if err != nil {
		return err
	}
	producer, err := client.CreateProducer(pulsar.ProducerOptions{
		Topic:              o.topic,
		DisableBatching:    !o.batching,
		CompressionType:    compression,
		MaxPendingMessages: 1000,
		SendTimeout:        o.sendTimeout,
	})
	if err != nil {
		return err
	}
	defer producer.Close()
	start := time.Now()
	var pending sync.WaitGroup
	for i := 0; i < o.messages; i++ {
		if o.rate > 0 {
			due := start.Add(time.Duration(float64(i) / o.rate * float64(time.Second)))
			time.Sleep(time.Until(due))
		}
		index, sentAt := i, time.Now()
		pending.Add(1)
		producer.SendAsync(ctx, &pulsar.ProducerMessage{Payload: payload(i)},
			func(id pulsar.MessageID, _ *pulsar.ProducerMessage, err error) {
				defer pending.Done()
				t.mu.Lock()
				defer t.mu.Unlock()
				if err != nil {
					t.errors++
					if t.firstErr == "" {
						t.firstErr = err.Error()
					}
					return
				}
				p := id.PartitionIdx()
				t.acked[p] = append(t.acked[p], index)
				t.ackedIDs[p] = append(t.ackedIDs[p], idText(id))
				t.ackedAll = append(t.ackedAll, index)
				if o.latencies {
					t.latency[index] = float64(time.Since(sentAt).Microseconds()) / 1000
				}
			})
		*sent = i + 1
	}
	if err := producer.Flush(); err != nil {
		fmt.Fprintln(os.Stderr, "flush:", err)
	}
	pending.Wait()
	return nil
}

func run(o *options) report {
	started := time.Now()
	deadline := started.Add(o.timeout)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	t := &tally{acked: map[int32][]int{}, ackedIDs: map[int32][]string{}, received: map[int32][]int{},
		recvIDs: map[int32][]string{}, seen: map[int]bool{}}
	if o.latencies {
		t.latency = make([]float64, o.messages)
	}
	out := report{Client: "go", Topic: o.topic, Mode: o.mode}
	fail := func(err error) report {
		text := err.Error()
		out.Error = &text
		return out
	}
	clientOptions := pulsar.ClientOptions{
		URL:              o.url,
		OperationTimeout: 30 * time.Second,
		Logger:           log.NewLoggerWithSlog(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))),
	}
	if o.tlsCA != "" {
		clientOptions.TLSTrustCertsFilePath = o.tlsCA
		clientOptions.TLSValidateHostname = true
	}
	client, err := pulsar.NewClient(clientOptions)
	if err != nil {
		return fail(err)
	}
	defer client.Close()
	consumer, err := client.Subscribe(pulsar.ConsumerOptions{
		Topic:                       o.topic,
		SubscriptionName:            o.subscription,
		Type:                        pulsar.Exclusive,
		SubscriptionInitialPosition: pulsar.SubscriptionPositionEarliest,
	})
	if err != nil {
		return fail(err)
	}
	defer consumer.Close()

	var produced sync.WaitGroup
	var produceErr error
	var produceSeconds float64
	producing := make(chan struct{})
	if o.mode == "roundtrip" {
		produced.Add(1)
		go func() {
			defer produced.Done()
			defer close(producing)
			begin := time.Now()
			produceErr = produce(ctx, client, o, t, &out.Sent)
			produceSeconds = time.Since(begin).Seconds()
		}()
	} else {
		close(producing)
	}

	lastMessage := time.Now()
	for time.Now().Before(deadline) {
		done := false
		select {
		case <-producing:
			done = true
		default:
		}
		if done && t.allAckedReceived(o) {
			break
		}
		if done && time.Since(lastMessage) > o.idle {
			break
		}
		receiveCtx, stop := context.WithTimeout(ctx, 200*time.Millisecond)
		message, err := consumer.Receive(receiveCtx)
		stop()
		if err != nil {
			continue
		}
		lastMessage = time.Now()
		index, err := indexOf(message.Payload())
		if err != nil {
			return fail(fmt.Errorf("undecodable payload %q", message.Payload()))
		}
		p := message.ID().PartitionIdx()
		t.mu.Lock()
		t.received[p] = append(t.received[p], index)
		t.recvIDs[p] = append(t.recvIDs[p], idText(message.ID()))
		t.seen[index] = true
		t.mu.Unlock()
		if err := consumer.Ack(message); err != nil {
			fmt.Fprintln(os.Stderr, "ack:", err)
		}
	}
	cancel()
	produced.Wait()
	if produceErr != nil {
		text := "producer: " + produceErr.Error()
		out.Error = &text
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	out.SendErrors = t.errors
	if t.firstErr != "" {
		out.FirstSendError = &t.firstErr
	}
	out.Acked = byPartition(t.acked)
	out.AckedIDs = byPartition(t.ackedIDs)
	out.Received = byPartition(t.received)
	out.ReceivedIDs = byPartition(t.recvIDs)
	out.LatencyMs = t.latency
	out.ProduceSeconds = produceSeconds
	out.ElapsedSeconds = time.Since(started).Seconds()
	return out
}

func byPartition[T any](values map[int32][]T) map[string][]T {
	out := map[string][]T{}
	for p, list := range values {
		out[strconv.Itoa(int(p))] = list
	}
	return out
}

func main() {
	o := &options{}
	flags := flag.NewFlagSet("go-client", flag.ContinueOnError)
	flags.SetOutput(io.Discard)
	flags.StringVar(&o.url, "url", "", "service URL")
	flags.StringVar(&o.topic, "topic", "", "topic")
	flags.IntVar(&o.messages, "messages", 100, "messages to produce")
	batching := flags.Bool("batching", true, "batch messages")
	noBatching := flags.Bool("no-batching", false, "send one message per SEND")
	flags.StringVar(&o.compression, "compression", "NONE", "NONE|LZ4|ZLIB|ZSTD")
	flags.StringVar(&o.subscription, "subscription", "peers", "subscription name")
	flags.StringVar(&o.tlsCA, "tls-ca", "", "CA file to trust (pulsar+ssl:// URLs)")
	flags.Float64Var(&o.rate, "rate", 0, "messages per second (0: as fast as possible)")
	timeout := flags.Float64("timeout", 120, "give up after this many seconds")
	sendTimeout := flags.Float64("send-timeout", 30, "a send not acknowledged in this many seconds fails")
	idle := flags.Float64("idle", 10, "stop consuming after this many idle seconds once produced")
	flags.BoolVar(&o.latencies, "latencies", false, "report each message's send-to-receipt latency")
	flags.StringVar(&o.mode, "mode", "roundtrip", "roundtrip | consume")
	if err := flags.Parse(os.Args[1:]); err != nil || o.url == "" || o.topic == "" ||
		(o.mode != "roundtrip" && o.mode != "consume") {
		fmt.Fprintln(os.Stderr, "go-client: --url and --topic are required; --mode is roundtrip or consume")
		os.Exit(2)
	}
	o.batching = *batching && !*noBatching
	o.timeout = time.Duration(*timeout * float64(time.Second))
	o.sendTimeout = time.Duration(*sendTimeout * float64(time.Second))
	o.idle = time.Duration(*idle * float64(time.Second))
	line, err := json.Marshal(run(o))
	if err != nil {
		fmt.Fprintln(os.Stderr, "go-client:", err)
		os.Exit(2)
	}
	fmt.Println(string(line))
}
