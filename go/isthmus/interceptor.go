package isthmus

import (
	"context"

	"google.golang.org/grpc"
)

// Interceptors compose as grpc-go composes them: the one given by WithUnaryInterceptor (or
// UnaryInterceptor on a server) runs first, outermost, then the chained ones in the order
// given, the call itself last.
//
// grpc-go's client interceptor types take its own *grpc.ClientConn, which an isthmus
// connection is not: isthmus passes nil there, and the invoker or streamer it hands an
// interceptor makes the call on the isthmus connection whatever cc it is given back.
//
// Raw calls (CallRaw, CallRawBlock, StartRaw) move bytes, not the messages interceptors are
// written for, and go around them.

// WithUnaryInterceptor sets the interceptor of the connection's unary calls, as
// grpc.WithUnaryInterceptor does: it runs before those of WithChainUnaryInterceptor. Its cc
// argument is nil (see grpc.UnaryClientInterceptor: that is grpc-go's own connection type);
// the invoker it is given makes the call on this connection.
func WithUnaryInterceptor(i grpc.UnaryClientInterceptor) DialOption {
	return func(o *dialOptions) { o.unaryInt = i }
}

// WithChainUnaryInterceptor adds interceptors of the connection's unary calls, run in the
// order given after the one from WithUnaryInterceptor, as grpc.WithChainUnaryInterceptor
// does. Their cc argument is nil, as WithUnaryInterceptor says.
func WithChainUnaryInterceptor(is ...grpc.UnaryClientInterceptor) DialOption {
	return func(o *dialOptions) { o.chainUnaryInts = append(o.chainUnaryInts, is...) }
}

// WithStreamInterceptor sets the interceptor of the connection's streaming calls, as
// grpc.WithStreamInterceptor does: it runs before those of WithChainStreamInterceptor, and may
// wrap the grpc.ClientStream it returns. Its cc argument is nil (see WithUnaryInterceptor);
// the streamer it is given starts the call on this connection.
func WithStreamInterceptor(i grpc.StreamClientInterceptor) DialOption {
	return func(o *dialOptions) { o.streamInt = i }
}

// WithChainStreamInterceptor adds interceptors of the connection's streaming calls, run in
// the order given after the one from WithStreamInterceptor, as
// grpc.WithChainStreamInterceptor does. Their cc argument is nil, as WithUnaryInterceptor
// says.
func WithChainStreamInterceptor(is ...grpc.StreamClientInterceptor) DialOption {
	return func(o *dialOptions) { o.chainStreamInts = append(o.chainStreamInts, is...) }
}

// ChainUnaryInterceptor adds interceptors of unary calls, run in the order given after the
// one from UnaryInterceptor, as grpc.ChainUnaryInterceptor does.
func ChainUnaryInterceptor(is ...grpc.UnaryServerInterceptor) ServerOption {
	return func(o *serverOptions) { o.chainUnary = append(o.chainUnary, is...) }
}

// ChainStreamInterceptor adds interceptors of streaming calls, run in the order given after
// the one from StreamInterceptor, as grpc.ChainStreamInterceptor does.
func ChainStreamInterceptor(is ...grpc.StreamServerInterceptor) ServerOption {
	return func(o *serverOptions) { o.chainStream = append(o.chainStream, is...) }
}

// withFirst is first (if any) followed by rest, in a new slice: appending to rest itself could
// write into the caller's array.
func withFirst[T any](first T, isSet bool, rest []T) []T {
	if !isSet {
		return rest
	}
	return append([]T{first}, rest...)
}

// unaryInvoker composes a connection's unary interceptors around final once, at Dial: the
// connection never changes, so unlike grpc-go's (which builds each invoker on the way in) a
// call through them makes no closure. nil for no interceptors, so that Invoke calls straight.
func unaryInvoker(ints []grpc.UnaryClientInterceptor, final grpc.UnaryInvoker) grpc.UnaryInvoker {
	if len(ints) == 0 {
		return nil
	}
	next := final
	for i := len(ints) - 1; i >= 0; i-- {
		in, inner := ints[i], next
		next = func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
			return in(ctx, method, req, reply, cc, inner, opts...)
		}
	}
	return next
}

// streamer is unaryInvoker for streaming calls.
func streamer(ints []grpc.StreamClientInterceptor, final grpc.Streamer) grpc.Streamer {
	if len(ints) == 0 {
		return nil
	}
	next := final
	for i := len(ints) - 1; i >= 0; i-- {
		in, inner := ints[i], next
		next = func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return in(ctx, desc, cc, method, inner, opts...)
		}
	}
	return next
}

// chainUnaryServer is one interceptor running ints in order (nil for none). The handler and
// its info differ per call, so the chain is built per call, as grpc-go builds it.
func chainUnaryServer(ints []grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	switch len(ints) {
	case 0:
		return nil
	case 1:
		return ints[0]
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		return ints[0](ctx, req, info, unaryHandlerFrom(ints, 1, info, handler))
	}
}

// unaryHandlerFrom is the handler that runs ints[i:] and then handler.
func unaryHandlerFrom(ints []grpc.UnaryServerInterceptor, i int, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) grpc.UnaryHandler {
	if i == len(ints) {
		return handler
	}
	return func(ctx context.Context, req any) (any, error) {
		return ints[i](ctx, req, info, unaryHandlerFrom(ints, i+1, info, handler))
	}
}

// chainStreamServer is chainUnaryServer for streaming calls.
func chainStreamServer(ints []grpc.StreamServerInterceptor) grpc.StreamServerInterceptor {
	switch len(ints) {
	case 0:
		return nil
	case 1:
		return ints[0]
	}
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return ints[0](srv, ss, info, streamHandlerFrom(ints, 1, info, handler))
	}
}

// streamHandlerFrom is the handler that runs ints[i:] and then handler.
func streamHandlerFrom(ints []grpc.StreamServerInterceptor, i int, info *grpc.StreamServerInfo, handler grpc.StreamHandler) grpc.StreamHandler {
	if i == len(ints) {
		return handler
	}
	return func(srv any, ss grpc.ServerStream) error {
		return ints[i](srv, ss, info, streamHandlerFrom(ints, i+1, info, handler))
	}
}
