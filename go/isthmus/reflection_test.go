package isthmus_test

import (
	"errors"
	"io"
	"slices"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// reflection.Register takes an isthmus server as it takes grpc-go's (it needs GetServiceInfo),
// so that grpcurl and other reflection clients list and describe its services, over shm://
// and over the socket.
func TestReflectionRegistersOnTheServerAndListsItsServices(t *testing.T) {
	shm, unix := fresh(t, "reflect")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	reflection.Register(s)
	info := s.GetServiceInfo()
	if echo := info["conformance.Echo"]; len(echo.Methods) != 4 || echo.Metadata != "conformance.proto" {
		t.Fatalf("GetServiceInfo: %+v", info)
	}
	serving(t, s, shm, unix)
	ctx := testContext(t)
	for name, conn := range map[string]grpc.ClientConnInterface{
		"isthmus shm": dialWith(t, shm), "grpc-go unix": newGrpcClient(t, unix),
	} {
		stream, err := rpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		ask := func(r *rpb.ServerReflectionRequest) *rpb.ServerReflectionResponse {
			if err := stream.Send(r); err != nil {
				t.Fatalf("%s: send: %v", name, err)
			}
			resp, err := stream.Recv()
			if err != nil {
				t.Fatalf("%s: recv: %v", name, err)
			}
			return resp
		}
		var listed []string
		for _, svc := range ask(&rpb.ServerReflectionRequest{
			MessageRequest: &rpb.ServerReflectionRequest_ListServices{},
		}).GetListServicesResponse().GetService() {
			listed = append(listed, svc.GetName())
		}
		if !slices.Contains(listed, "conformance.Echo") || !slices.Contains(listed, "grpc.reflection.v1.ServerReflection") {
			t.Errorf("%s: listed %v", name, listed)
		}
		files := ask(&rpb.ServerReflectionRequest{
			MessageRequest: &rpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "conformance.Echo"},
		}).GetFileDescriptorResponse().GetFileDescriptorProto()
		if len(files) == 0 {
			t.Errorf("%s: no file describes conformance.Echo", name)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			t.Errorf("%s: after CloseSend: %v", name, err)
		}
	}
}
