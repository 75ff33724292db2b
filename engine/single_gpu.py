"""The single-process pipeline: the whole model on one device, one view per step.

The step: render the view, L1 + SSIM loss (or ``--loss tile``: L1 + S3IM per
tile, fused with forward and backward on GPUs), backward through
rasterization and projection, the strategy's statistics, fused Adam, the
strategy's densification.
"""
import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.loss import l1_ssim_loss, psnr

from .model import GaussianModel
from .trainer import Trainer


class SingleGPUTrainer(Trainer):
    """``Trainer`` with the whole model in this process (on the GPU, or the CPU backend)."""

    def start_from(self, model_state, strategy_state=None):
        self.model = GaussianModel.from_state(model_state, self.backend)
        self.strategy_state = ({k: self.xp.asarray(a) for k, a in strategy_state.items()} if strategy_state
                               else self.strategy.initialize_state())

    def gather_state(self):
        return self.model.state(), {k: _backend.to_host(a) for k, a in self.strategy_state.items()}

    def whole_model(self):
        return self.model

    def train_step(self):
        c, model, strategy = self.cfg, self.model, self.strategy
        i = self.next_view()
        view = self.data.train[i]
        bg = self.step_background()
        degree = self.sh_degree_now()
        g = model.gaussians
        target = self.targets[i]  # random_background changes the render only, as in 3DGS
        if c.loss == "tile":
            frame, grad, loss = self._tile_loss_step(g, view.camera, target, degree, bg)
        else:
            frame = ns.render(g, view.camera, sh_degree=degree, background=bg, antialias=c.antialias,
                              backend=self.backend, check=False)  # checked at log steps: a sync
            loss, d_img = l1_ssim_loss(frame.image, target, c.lambda_dssim, backend=self.backend, lazy=True)
            _, grad = ns.render_backward(g, frame, d_img, out=model.grad_gaussians, backend=self.backend)
        self._progress_view = (frame.image, target)
        self.add_strategy_gradients()  # on top of what the backward wrote
        strategy.after_backward(model, self.strategy_state, self.step, frame.projection, grad)
        lr, cols = self.learning_rates()
        visible = frame.projection.counts > 0 if c.visible_adam else None
        model.adam.step(model.grads.data, cols, visible)
        self.step += 1
        events = strategy.after_optimizer(model, self.strategy_state, self.step, self.context(lr_means=lr["means"]))
        return loss, events

    def _tile_loss_step(self, g, camera, target, degree, bg):
        """Render, tile-local loss and backward (ByteSplat's fused kernel on GPUs).
        -> (frame, screen-space gradients, loss)."""
        from numbasplat.rendering import rasterize_tile_loss
        from numbasplat.tile_loss import s3im_permutations
        c = self.cfg
        p = ns.project(g, camera, sh_degree=degree, antialias=c.antialias, backend=self.backend, check=False)
        b = ns.bin_tiles(p, backend=self.backend)
        perms = self.xp.asarray(s3im_permutations(self.rng, c.s3im_repeats))
        loss, grad, image, stats = rasterize_tile_loss(p, b, target, perms, c.lambda_s3im, bg, want_image=True,
                                                       backend=self.backend, lazy=True)
        ns.project_backward(g, p, grad, self.model.grad_gaussians, accumulate=False, backend=self.backend)
        self.tile_stats = stats  # fused tiles and Gaussians on fused tiles, for the log
        return ns.Frame(p, b, ns.Render(image, None, None, None, bg)), grad, loss

    def progress_psnr(self):
        image, target = self._progress_view
        return psnr(image, target)
