package tcp

import (
	"net"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// A batch of writes of at least batchMin bytes goes out by writev: each
// frame's header from an arena and its payload from where it lies in
// registered host memory, with no copy through the buffered writer (a
// 4096 x 4 KiB batch copied its 16 MiB once more at the sender). A
// smaller one stays buffered, so that its writes and the fence after them
// leave in one system call.
const (
	batchMin    = gatherMin
	batchFrames = 512     // frames per writev: two iovecs each, IOV_MAX is 1024
	batchBytes  = 4 << 20 // payload per writev
)

// batched is the frames queued for one writev, and the hold that keeps
// a batch's source region registered until its frames are sent.
type batched struct {
	hdrs    []byte   // the frames' headers: an arena never grown (bufs point into it)
	bufs    [][]byte // header, payload, header, payload ...
	out     net.Buffers
	bytes   uint64
	held    memory.Held
	region  memory.Region
	holding bool
}

// batches says whether descs' writes go by writev (sendWrites).
func (t *conn) batches(descs []desc.Desc) bool {
	if t.pull {
		return false // same host: the frames carry addresses, not bytes
	}
	var n uint64
	for _, d := range descs {
		if n += d.Len; n >= batchMin {
			return true
		}
	}
	return false
}

// queueWrite queues slice sl's frame, marked with m, for the next writev.
// It queues nothing (false) for a device-memory source, which is staged
// through the buffered writer as before.
func (t *conn) queueWrite(sl transport.Slice, m wire.Status) (bool, error) {
	b := &t.batch
	if !b.holding || !b.region.Contains(sl.Src, sl.Len) {
		if err := t.flushBatch(); err != nil {
			return false, err
		}
		h, region, mem, err := t.local.HoldRegion(sl.Src, sl.Len, t.cut)
		if err != nil {
			return false, err
		}
		if mem.Device {
			h.Release()
			return false, nil
		}
		b.held, b.region, b.holding = h, region, true
	}
	if err := t.queue(wire.Header{Op: wire.OpWrite, Status: m, Addr: sl.Dst, Len: sl.Len}, memory.BytesAt(sl.Src, sl.Len)); err != nil {
		return false, err
	}
	if len(b.hdrs) == cap(b.hdrs) || b.bytes >= batchBytes {
		return true, t.writeBatch()
	}
	return true, nil
}

// queue numbers frame h and queues it, with its payload where it lies,
// for the next writev. payload must stay as it is until that is sent.
func (t *conn) queue(h wire.Header, payload []byte) error {
	if t.w.Buffered() > 0 { // frames buffered before this go first
		if err := t.w.Flush(); err != nil {
			return ioErr("send", err)
		}
	}
	b := &t.batch
	if b.hdrs == nil {
		b.hdrs = make([]byte, 0, batchFrames*wire.HeaderSize)
	}
	t.nextID++
	h.ID = t.nextID
	at := len(b.hdrs)
	b.hdrs = b.hdrs[:at+wire.HeaderSize]
	h.Encode(b.hdrs[at:])
	b.bufs = append(b.bufs, b.hdrs[at:at+wire.HeaderSize:at+wire.HeaderSize], payload)
	b.bytes += uint64(len(payload))
	return nil
}

// writeBatch sends the queued frames, keeping the hold for more.
func (t *conn) writeBatch() error {
	b := &t.batch
	if len(b.bufs) == 0 {
		return nil
	}
	b.out = b.bufs // WriteTo consumes out; bufs keeps the array for reuse
	_, err := writeBuffers(t.c, &b.out)
	b.reset()
	if err != nil {
		return ioErr("send", err)
	}
	return nil
}

// flushBatch sends the queued frames and lets go of their region.
func (t *conn) flushBatch() error {
	err := t.writeBatch()
	t.dropBatch()
	return err
}

// dropBatch forgets what is queued, unsent, and lets go of its region:
// after an error the connection is closed anyway.
func (t *conn) dropBatch() {
	b := &t.batch
	b.reset()
	if b.holding {
		b.held.Release()
		b.held, b.holding = memory.Held{}, false
	}
}

// reset empties the queue, keeping no reference to the caller's memory.
func (b *batched) reset() {
	clear(b.bufs)
	b.bufs, b.hdrs, b.bytes, b.out = b.bufs[:0], b.hdrs[:0], 0, nil
}
