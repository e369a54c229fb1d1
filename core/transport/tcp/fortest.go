package tcp

// HoldReadsForTest calls hook as the target takes each read frame: with
// "arrived" before the read is recorded against quiesces, and "reading"
// after it is (a quiesce now waits for it). A test blocks in hook to hold
// a read at either point; nil removes it.
func (t *Transport) HoldReadsForTest(hook func(phase string)) { t.target.readHook = hook }
