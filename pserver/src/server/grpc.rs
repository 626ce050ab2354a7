//! The gRPC adapter over the pserver's operations: hands each call to the service (the
//! job and token headers are checked before, by the interceptor `run` puts in front).

use std::sync::Arc;

use edl_proto::pserver as pb;
use tonic::{Request, Response, Status};

use super::service::Service;

/// The gRPC adapter over the pserver's operations.
#[derive(Debug, Clone)]
pub struct PsGrpc {
    pub(super) svc: Arc<Service>,
}

impl PsGrpc {
    /// Job and token were checked by the interceptor ([`edl_proto::headers::Credentials`])
    /// before the body was decoded; what is left is whether the pserver still serves.
    fn check<T>(&self, _req: &Request<T>) -> Result<(), Status> {
        Ok(self.svc.serving()?)
    }
}

#[tonic::async_trait]
impl pb::parameter_server_server::ParameterServer for PsGrpc {
    async fn init(
        &self,
        req: Request<pb::InitRequest>,
    ) -> Result<Response<pb::InitResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.init(req.into_inner()).await?))
    }

    async fn finish_init(
        &self,
        req: Request<pb::FinishInitRequest>,
    ) -> Result<Response<pb::FinishInitResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.finish_init(req.into_inner()).await?))
    }

    async fn push(
        &self,
        req: Request<pb::PushRequest>,
    ) -> Result<Response<pb::PushResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.push(req.into_inner()).await?))
    }

    async fn pull(
        &self,
        req: Request<pb::PullRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.pull(req.into_inner()).await?))
    }

    async fn pull_sparse(
        &self,
        req: Request<pb::PullSparseRequest>,
    ) -> Result<Response<pb::PullSparseResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.pull_sparse(req.into_inner()).await?))
    }

    async fn leave(
        &self,
        req: Request<pb::LeaveRequest>,
    ) -> Result<Response<pb::LeaveResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.leave(req.into_inner()).await?))
    }

    async fn task_done(
        &self,
        req: Request<pb::TaskDoneRequest>,
    ) -> Result<Response<pb::TaskDoneResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.task_done(req.into_inner()).await?))
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.status()?))
    }
}
