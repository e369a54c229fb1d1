package core

import (
	"runtime"
	"sync/atomic"

	"github.com/mcguard/mcguard/core/desc"
)

// A chunk's sources are digested beside its writes on another goroutine.
// That goroutine is a worker kept for the next chunk, not a new one per
// chunk: a goroutine, its closure and its channel were three allocations
// per chunk of a transfer that should make none.

// digestJob is one chunk's digests to take: a session's own, reused by
// each of its transfers (under the session's lock, one at a time).
type digestJob struct {
	chunk   []desc.Desc
	digests []uint64
	done    chan error // made once; the result of each run
}

// digesters are a guard's idle digest workers. A job goes to an idle one,
// else to a new one; a worker that finds more than maxIdleDigesters idle
// ends, so a burst of concurrent sessions leaves no crowd behind, and
// Close ends them all.
type digesters struct {
	jobs chan *digestJob // unbuffered: a send succeeds only to a worker waiting
	idle atomic.Int32
}

func maxIdleDigesters() int32 { return int32(max(runtime.GOMAXPROCS(0), 2)) }

// digestInBackground takes chunk's digests into digests on a worker; the
// result comes on the returned channel, which the caller must read before
// it reuses job, chunk or digests.
func (g *Guard) digestInBackground(job *digestJob, chunk []desc.Desc, digests []uint64) <-chan error {
	if job.done == nil {
		job.done = make(chan error, 1)
	}
	job.chunk, job.digests = chunk, digests
	select {
	case g.digesters.jobs <- job:
	default:
		go g.digestWorker(job)
	}
	return job.done
}

// digestWorker runs job, then waits for the next while it is one of few
// idle, or the guard closes.
func (g *Guard) digestWorker(job *digestJob) {
	for {
		chunk, digests, done := job.chunk, job.digests, job.done
		// Nothing of the caller's kept once it has its result (the job
		// is part of its session): it may reuse the job at once.
		job.chunk, job.digests, job = nil, nil, nil
		done <- g.digestSources(chunk, digests)
		if g.digesters.idle.Add(1) > maxIdleDigesters() {
			g.digesters.idle.Add(-1)
			return
		}
		select {
		case job = <-g.digesters.jobs:
			g.digesters.idle.Add(-1)
		case <-g.ctx.Done():
			g.digesters.idle.Add(-1)
			return
		}
	}
}
