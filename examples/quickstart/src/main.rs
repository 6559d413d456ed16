use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_flex::{Flex, FlexDevice};

// The one changed type: this was `Autodiff<Flex>`.
type B = Autodiff<DistributedBackend<Flex>>;

#[derive(Module, Debug)]
struct Model<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Model<B> {
    fn new(device: &B::Device) -> Self {
        Model {
            hidden: LinearConfig::new(8, 32).init(device),
            out: LinearConfig::new(32, 1).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out.forward(self.relu.forward(self.hidden.forward(x)))
    }
}

fn main() -> Result<(), burn_dist::DistError> {
    let device = FlexDevice;
    // New: join the job (a job of one rank when not started by burn-dist-run) and give every
    // rank rank 0's weights.
    let mut ddp = Ddp::init(DdpConfig::new())?;
    let mut model = ddp.prepare(Model::<B>::new(&device))?;

    let mut optim = AdamConfig::new().init();
    for step in 1..=200 {
        // Each rank draws its own batch: the global batch is 64 × the number of ranks.
        let x = Tensor::<B, 2>::random([64, 8], Distribution::Normal(0.0, 1.0), &device);
        let y = x.clone().sum_dim(1).sin();
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        // The gradients come back averaged over every rank.
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        if ddp.is_main() && step % 50 == 0 {
            println!("step {step}: loss {:.4}", loss.into_scalar());
        }
    }
    Ok(())
}
