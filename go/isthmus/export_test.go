package isthmus

// LeaveStreamReadsToTheReader makes the streams cc starts wait for their messages without
// reading the connection, as before ADR 0029: the baseline of the ping-pong test.
func LeaveStreamReadsToTheReader(cc *ClientConn) { cc.readerReads = true }

// LiveHandles is the C library's count of handles made and not yet freed.
func LiveHandles() int { return liveHandles() }
